"""The coordinator's trainer stream over real gRPC: a trainer that goes away and comes back on the
same address gets every sample sent meanwhile, whatever state the broken streams were in."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pipelinerl.common.errors import PipelineError
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.coordinator import submitter as submitter_module
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.submitter import TrainerSubmitter
from pipelinerl.trainer import server as trainer_server
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.types import Disposition, SampleAck
from tests.fakes import FakeTrainer


async def serve_trainer(port: int = 0) -> GrpcServer:
    server = GrpcServer(
        ServiceSettings(host="127.0.0.1", port=port, drain_seconds=0),
        [trainer_server.registration(FakeTrainer())],
    )
    await server.start()
    return server


def group(group_id: str) -> list[Sample]:
    tokens = TokenSequence([3], [-0.5], [0])
    return [Sample(f"{group_id}-{i}", group_id, [1, 2], tokens, 1.0, group_size=2) for i in range(2)]


async def trained(submitter: TrainerSubmitter, samples: list[Sample]) -> list[SampleAck]:
    return await asyncio.wait_for(asyncio.gather(*submitter.send(samples).values()), timeout=10)


async def test_a_trainer_back_after_failed_reconnects_gets_what_is_sent_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer stops while the stream is idle and reconnects fail while it is down; once it is
    back, a group sent is trained. (Handed to gRPC as a request iterator, the reader of each ended
    stream stayed blocked on the submitter's queue and took the next group to a dead call: a
    restarted trainer never got the resend and the run stalled.)"""
    monkeypatch.setattr(submitter_module, "RECONNECT_S", 0.05)
    server = await serve_trainer()
    port = server.port
    journal = Journal(tmp_path / "journal.sqlite")
    async with TrainerClient(f"127.0.0.1:{port}") as client:
        submitter = TrainerSubmitter(client, journal)
        submitter.start()
        try:
            assert {a.disposition for a in await trained(submitter, group("before"))} == {Disposition.TRAINED}
            await server.stop(grace=0)
            await asyncio.sleep(2)  # a reconnect refused (gRPC backs off about a second between tries)
            server = await serve_trainer(port)
            await asyncio.sleep(2)  # connected again
            after = await trained(submitter, group("after"))
        finally:
            await submitter.close()
            await server.stop(grace=0)
            journal.close()
    assert {a.disposition for a in after} == {Disposition.TRAINED}


async def test_a_stream_that_ended_reads_no_more_of_its_batches() -> None:
    """Once `submit_durably` has ended, broken by the trainer, what its source yields next stays
    there for the next stream."""
    server = await serve_trainer()
    source: asyncio.Queue[list[Sample]] = asyncio.Queue()

    async def batches() -> AsyncIterator[list[Sample]]:
        while True:
            yield await source.get()

    source.put_nowait(group("a"))
    async with TrainerClient(f"127.0.0.1:{server.port}") as client:
        stream = client.submit_durably(batches())
        acks, _ = await anext(stream)
        assert [a.disposition for a in acks] == [Disposition.ACCEPTED] * 2
        await server.stop(grace=0)
        with pytest.raises(PipelineError):
            async for _ in stream:
                pass
        source.put_nowait(group("b"))
        await asyncio.sleep(0.2)
    assert source.qsize() == 1
