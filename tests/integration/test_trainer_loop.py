"""The real trainer service on the tiny preset: acks through a step, lag policy, weights that reach
a receiver, and a resume from checkpoint that trains nothing twice."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest
import yaml

from pipelinerl.common.channel import free_port
from pipelinerl.common.types import Sample, Segment, SegmentKind, TokenSequence
from pipelinerl.trainer.__main__ import build
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.config import LearnerConfig, TrainerSettings
from pipelinerl.trainer.types import Disposition, SampleAck
from pipelinerl.weights.types import WatchRequest
from tests.integration.processes import start_trainer

pytestmark = pytest.mark.slow


def tokens(i: int, version: int) -> TokenSequence:
    return TokenSequence([12 + i, 13], [-1.0, -1.5], [version, version])


def group(group_id: str, version: int, rewards: Sequence[float]) -> list[Sample]:
    size = len(rewards)
    return [
        Sample(f"{group_id}-{i}", group_id, [1, 10, 11], tokens(i, version), reward, group_size=size)
        for i, reward in enumerate(rewards)
    ]


def episode_group(
    group_id: str, version: int, rewards: Sequence[float], first_turn: int | None = None
) -> list[Sample]:
    """Multi-turn samples: a model turn (of `first_turn`'s version, `version` by default), a tool's
    reply (context), a model turn of `version`."""
    size, first = len(rewards), version if first_turn is None else first_turn
    segments = (Segment(SegmentKind.MODEL, 2), Segment(SegmentKind.CONTEXT, 3), Segment(SegmentKind.MODEL, 2))
    logprobs, versions = [-1.0, -1.5, -0.5, -2.0], [first, first, version, version]  # model tokens only
    return [
        Sample(f"{group_id}-{i}", group_id, [1, 10, 11],
               TokenSequence([12 + i, 13, 40, 41, 42, 14, 15 + i], logprobs, versions), reward,
               group_size=size, segments=segments)
        for i, reward in enumerate(rewards)
    ]  # fmt: skip


async def batches(*groups: list[Sample]) -> AsyncIterator[list[Sample]]:
    for g in groups:
        yield g


def final(acks: list[SampleAck]) -> dict[str, Disposition]:
    return {a.sample_id: a.disposition for a in acks if a.disposition.final}


class Stream:
    """One SubmitSamples stream fed group by group, its acks collected as they come."""

    def __init__(self, client: TrainerClient) -> None:
        self._queue: asyncio.Queue[Sequence[Sample]] = asyncio.Queue()
        self.acks: list[SampleAck] = []
        self._task = asyncio.create_task(self._read(client))

    async def _requests(self) -> AsyncIterator[Sequence[Sample]]:
        while True:
            yield await self._queue.get()

    async def _read(self, client: TrainerClient) -> None:
        async for ack in client.submit(self._requests()):
            self.acks.append(ack)

    async def send(self, samples: Sequence[Sample]) -> None:
        await self._queue.put(samples)

    async def trained(self, *sample_ids: str, timeout_s: float = 30) -> set[int]:
        """Wait until every id is TRAINED; the versions their step produced."""
        async with asyncio.timeout(timeout_s):
            while not set(sample_ids) <= {
                a.sample_id for a in self.acks if a.disposition is Disposition.TRAINED
            }:
                await asyncio.sleep(0.02)
        return {
            a.version for a in self.acks if a.sample_id in sample_ids and a.disposition is Disposition.TRAINED
        }

    async def close(self) -> None:
        """Leave without waiting: samples still held would keep the stream open."""
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def settings(tmp_path: Path) -> TrainerSettings:
    return TrainerSettings(
        port=0, run_id="test", samples_per_step=4, max_lag=0, checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=1, metrics_file=tmp_path / "metrics.jsonl", learner=LearnerConfig(lr=1e-3),
    )  # fmt: skip


async def test_train_publish_lag_and_resume(tmp_path: Path) -> None:
    server = await build(settings(tmp_path))
    await server.start()
    try:
        async with TrainerClient(server.address) as client:
            acks = [a async for a in client.submit(batches(group("a", 0, [0, 1]), group("b", 0, [0, 1])))]
            assert final(acks) == dict.fromkeys(["a-0", "a-1", "b-0", "b-1"], Disposition.TRAINED)
            assert {a.version for a in acks if a.disposition is Disposition.TRAINED} == {1}
            # The trainer is at version 1 now: version-0 tokens are over max_lag 0, version 2 is the future.
            acks = [
                a async for a in client.submit(batches(group("old", 0, [0, 1]), group("future", 2, [0, 1])))
            ]
            assert final(acks) == {
                "old-0": Disposition.DROPPED, "old-1": Disposition.DROPPED,
                "future-0": Disposition.REJECTED, "future-1": Disposition.REJECTED,
            }  # fmt: skip
            rejected = next(a for a in acks if a.sample_id == "future-0")
            assert (
                rejected.error is not None
                and rejected.error.violations[0].field == "samples[0].completion.versions"
            )
            notice = await anext(aiter(client.watch_weights(WatchRequest("inference-0", -1, False))))
            assert notice.version.version == 1 and notice.version.run_id == "test"
            status = await client.status()
            assert (status.trained_samples, status.dropped_samples, status.rejected_samples) == (4, 2, 2)
    finally:
        await server.stop(grace=1)
    [metrics] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (
        metrics["version"] == 1 and metrics["grad_norm"] > 0 and metrics["lag_histogram"] == {"0": 8}
    )  # tokens, not samples

    resumed = await build(settings(tmp_path))
    await resumed.start()
    try:
        async with TrainerClient(resumed.address) as client:
            assert (await client.status()).version.version == 1
            acks = [a async for a in client.submit(batches(group("a", 1, [0, 1])))]
            assert final(acks) == {"a-0": Disposition.DUPLICATE, "a-1": Disposition.DUPLICATE}
    finally:
        await resumed.stop(grace=1)


async def test_a_sample_resent_while_held_is_trained_once_and_acked_on_the_new_stream(tmp_path: Path) -> None:
    server = await build(settings(tmp_path))
    await server.start()
    try:
        async with TrainerClient(server.address) as client:
            first = Stream(client)
            await first.send(group("a", 0, [0, 1]))  # a complete group, half a step: held
            async with asyncio.timeout(10):
                while len(first.acks) < 2:
                    await asyncio.sleep(0.02)
            await first.close()  # the coordinator lost its stream and reconnects
            second = Stream(client)
            await second.send(group("a", 0, [0, 1]))
            await second.send(group("b", 0, [0, 1]))
            assert await second.trained("a-0", "a-1", "b-0", "b-1") == {1}
            await second.close()
            status = await client.status()
            assert (status.version.version, status.trained_samples) == (1, 4)
    finally:
        await server.stop(grace=1)
    [metrics] = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert metrics["samples"] == 4


@pytest.mark.parametrize("make_group", [group, episode_group], ids=["single-turn", "multi-turn"])
async def test_trainer_killed_after_a_checkpoint_resumes_its_version_and_trains_nothing_twice(
    tmp_path: Path, make_group: Callable[[str, int, Sequence[float]], list[Sample]]
) -> None:
    port = free_port()
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump({
        "port": port, "run_id": "kill", "samples_per_step": 4, "checkpoint_every": 1,
        "checkpoint_dir": str(tmp_path / "ckpt"), "learner": {"lr": 1e-3}, "broadcast_backend": "none",
    }))  # fmt: skip
    command = [sys.executable, "-m", "pipelinerl.trainer", "--config", str(config)]
    address = f"127.0.0.1:{port}"

    proc = await start_trainer(command, address)
    try:
        async with TrainerClient(address) as client:
            first = batches(make_group("a", 0, [0, 1]), make_group("b", 0, [0, 1]))
            acks = [a async for a in client.submit(first)]
            assert final(acks) == dict.fromkeys(["a-0", "a-1", "b-0", "b-1"], Disposition.TRAINED)
            # TRAINED is acked before the checkpoint of that version is written; wait for it.
            async with asyncio.timeout(30):
                while not (tmp_path / "ckpt" / "latest").exists():
                    await asyncio.sleep(0.05)
            stream = Stream(client)
            await stream.send(make_group("c", 1, [0, 1]))  # accepted, waiting for a full step: lost
            async with asyncio.timeout(10):
                while len(stream.acks) < 2:
                    await asyncio.sleep(0.02)
            proc.kill()  # SIGKILL: no drain, no checkpoint at stop
            await stream.close()
    finally:
        proc.kill()
        proc.wait()

    proc = await start_trainer(command, address)
    try:
        async with TrainerClient(address) as client:
            assert (await client.status()).version.version == 1
            resent = batches(
                make_group("a", 1, [0, 1]), make_group("c", 1, [0, 1]), make_group("d", 1, [0, 1])
            )
            acks = [a async for a in client.submit(resent)]
            assert final(acks) == {
                "a-0": Disposition.DUPLICATE, "a-1": Disposition.DUPLICATE,
                "c-0": Disposition.TRAINED, "c-1": Disposition.TRAINED,
                "d-0": Disposition.TRAINED, "d-1": Disposition.TRAINED,
            }  # fmt: skip
            assert (await client.status()).version.version == 2
    finally:
        proc.kill()
        proc.wait()


async def test_a_trainer_stopped_while_a_broadcast_waits_for_a_receiver_exits_within_its_drain(
    tmp_path: Path,
) -> None:
    """A receiver that watches as a broadcast member but never joins (its process wedged or gone)
    holds v1's broadcast until the group's timeout; SIGTERM must not wait for that timeout, or a
    Kubernetes grace period ends in SIGKILL."""
    port = free_port()
    config = tmp_path / "trainer.yaml"
    config.write_text(yaml.safe_dump({
        "port": port, "run_id": "stop", "samples_per_step": 4, "drain_seconds": 1,
        "learner": {"lr": 1e-3}, "broadcast_timeout_s": 120,
    }))  # fmt: skip
    address = f"127.0.0.1:{port}"
    proc = await start_trainer([sys.executable, "-m", "pipelinerl.trainer", "--config", str(config)], address)
    try:
        async with TrainerClient(address) as client:
            notices = client.watch_weights(WatchRequest("ghost", -1, True, "")).__aiter__()
            assert (await anext(notices)).version.version == 0
            acks = [a async for a in client.submit(batches(group("a", 0, [0, 1]), group("b", 0, [0, 1])))]
            assert set(final(acks).values()) == {Disposition.TRAINED}
            v1 = await asyncio.wait_for(anext(notices), 30)
            assert v1.version.version == 1 and v1.broadcast is not None  # the ghost is a member
            await asyncio.sleep(1.0)  # the broadcast is waiting at its rendezvous
            stopped = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 60)
        assert code == 0
        assert time.monotonic() - stopped < 10, "the exit waited for the broadcast's timeout"
    finally:
        proc.kill()
        proc.wait()
