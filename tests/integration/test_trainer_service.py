"""The trainer servicer and client over gRPC, with a fake trainer core."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument
from pipelinerl.common.types import Sample, TokenSequence, WeightVersion
from pipelinerl.trainer import server as trainer_server
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.types import Disposition
from pipelinerl.weights.types import WatchRequest, crc32
from tests.fakes import FakeTrainer


def sample(sample_id: str, logprobs: list[float] | None = None) -> Sample:
    tokens = TokenSequence([5, 6, 7], logprobs if logprobs is not None else [-0.1, -0.2, -0.3], [0, 0, 1])
    return Sample(sample_id, "g", [1, 2], tokens, reward=1.0)


async def batches(*groups: Sequence[Sample]) -> AsyncIterator[Sequence[Sample]]:
    for group in groups:
        yield group


async def test_submit_acks_every_sample_once_trained_and_duplicates(start_server) -> None:
    core = FakeTrainer()
    address = await start_server(trainer_server.registration(core))
    async with TrainerClient(address) as client:
        acks = [a async for a in client.submit(batches([sample("a"), sample("b")], [sample("c")]))]
        final = {a.sample_id: a.disposition for a in acks if a.disposition.final}
        assert final == {"a": Disposition.TRAINED, "b": Disposition.TRAINED, "c": Disposition.TRAINED}
        again = [a async for a in client.submit(batches([sample("a")]))]
        assert [(a.sample_id, a.disposition) for a in again] == [("a", Disposition.DUPLICATE)]


async def test_invalid_sample_is_rejected_naming_the_field_and_not_trained(start_server) -> None:
    core = FakeTrainer()
    address = await start_server(trainer_server.registration(core))
    async with TrainerClient(address) as client:
        bad_length, positive = sample("x", [-0.1]), sample("y", [-0.1, 0.5, -0.1])
        acks = [a async for a in client.submit(batches([bad_length, sample("ok"), positive]))]
    rejected = {a.sample_id: a.error for a in acks if a.disposition is Disposition.REJECTED}
    assert rejected["x"] is not None and rejected["x"].code == "INVALID_ARGUMENT"
    assert [v.field for v in rejected["x"].violations] == ["samples[0].completion.logprobs"]
    assert [v.field for v in rejected["y"].violations] == ["samples[2].completion.logprobs"]
    assert set(core.trained) == {"ok"}


async def test_watch_and_fetch_weights(start_server) -> None:
    core = FakeTrainer()
    address = await start_server(trainer_server.registration(core))
    async with TrainerClient(address) as client:
        notices = [n async for n in client.watch_weights(WatchRequest("inference-0", -1, False))]
        [bucket] = notices[0].layout.buckets
        data = b"".join([c.data async for c in client.fetch_weights(notices[0].version)])
        assert crc32(data) == bucket.checksum.value and len(data) == bucket.num_bytes
        with pytest.raises(FailedPrecondition):
            [c async for c in client.fetch_weights(WeightVersion(7, "fake"))]
        with pytest.raises(InvalidArgument) as exc:
            [n async for n in client.watch_weights(WatchRequest("", -1, False))]
        assert exc.value.violations[0].field == "receiver_id"
        assert (await client.status()).version.version == 0
