"""Weights from a stand-in trainer process to a receiver: gloo broadcast per membership, FetchWeights
for late joiners and bad buckets, old weights kept when a version cannot be verified, and a
membership that changes while a broadcast runs without holding up training."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelinerl.common.types import WeightVersion
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights.receiver import WeightReceiver
from pipelinerl.weights.types import WatchRequest, WeightLayout, WeightNotice
from tests.integration.processes import port_file_of, server_process
from tests.integration.standin_trainer import expected_weights

pytestmark = pytest.mark.slow


class Applied:
    """Records what the engine would have loaded."""

    def __init__(self, big_mib: int = 0) -> None:
        self.big_mib = big_mib
        self.versions: list[int] = []
        self.mismatches: list[int] = []
        self.at: dict[int, float] = {}
        """When each version was applied (wall clock, as the trainer's events)."""

    async def __call__(
        self, version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]
    ) -> None:
        tensors = bucketing.unpack(layout, buckets)
        expected = expected_weights(version.version, self.big_mib)
        if tensors.keys() != expected.keys() or not all(
            torch.equal(tensors[k], expected[k]) for k in expected
        ):
            self.mismatches.append(version.version)
        self.versions.append(version.version)
        self.at[version.version] = time.time()


async def follow(
    port: int, applied: Applied, until_version: int, timeout_s: float, **kwargs
) -> WeightReceiver:
    async with TrainerClient(f"127.0.0.1:{port}") as client:
        receiver = WeightReceiver(client, "inference-0", applied, **kwargs)
        task = asyncio.create_task(receiver.run())
        try:
            for _ in range(int(timeout_s * 20)):
                if receiver.version is not None and receiver.version.version >= until_version:
                    break
                await asyncio.sleep(0.05)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return receiver


async def test_versions_arrive_by_broadcast_and_late_join_by_fetch(tmp_path: Path) -> None:
    async with server_process("standin_trainer.py", tmp_path, "--versions", "5", "--interval", "1.0") as (
        _,
        port,
    ):
        applied = Applied()
        receiver = await follow(port, applied, until_version=4, timeout_s=60)
    assert applied.mismatches == []
    assert applied.versions == sorted(applied.versions) and applied.versions[-1] == 4
    # The first version seen is fetched (no group yet); the later ones come by broadcast.
    assert receiver.stats.fetches >= 1 and receiver.stats.broadcasts >= 2
    assert receiver.stats.failed_updates == 0


async def test_fetch_only_receiver(tmp_path: Path) -> None:
    async with server_process("standin_trainer.py", tmp_path, "--versions", "3", "--interval", "0.5") as (
        _,
        port,
    ):
        applied = Applied()
        receiver = await follow(port, applied, until_version=2, timeout_s=60, accepts_broadcast=False)
    assert applied.mismatches == [] and applied.versions[-1] == 2
    assert receiver.stats.broadcasts == 0


async def test_unverifiable_version_keeps_the_old_weights(tmp_path: Path) -> None:
    async with server_process(
        "standin_trainer.py", tmp_path, "--versions", "3", "--interval", "1.5", "--corrupt"
    ) as (_, port):
        applied = Applied()
        receiver = await follow(port, applied, until_version=2, timeout_s=60, fetch_attempts=2)
    # Version 1 is announced with a wrong checksum: never applied, counted, and version 2 still lands.
    assert 1 not in applied.versions and applied.versions[-1] == 2
    assert applied.mismatches == []
    assert receiver.stats.failed_updates >= 1
    assert "checksum mismatch" in receiver.stats.last_error


# ---- membership changes while a broadcast runs ------------------------------------------------
#
# A stand-in trainer publishes a version each time the test asks (the file PORT_FILE.next), and logs
# each publish and each end of a broadcast to PORT_FILE.events. Member "doomed" is a receiver of its
# own process, stopped (SIGSTOP) so that a broadcast to it is surely in progress, then killed.

BIG_MIB = 32
"""Far more than the sockets between two processes buffer: a stopped member holds the broadcast."""
WAIT_S = 45.0


class Trainer:
    def __init__(self, tmp_path: Path, port: int) -> None:
        self.port_file = port_file_of("standin_trainer.py", tmp_path)
        self.port = port

    def events(self, kind: str) -> list[dict[str, Any]]:
        lines = Path(f"{self.port_file}.events").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    async def broadcasts_ended(self, ok: int, failed: int, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The event of the broadcast that brought the counts to `ok` and `failed`."""

        def counts() -> list[dict[str, Any]]:
            ended = self.events("broadcast_ended")
            return [e for e in ended if (e["broadcasts"], e["failed_broadcasts"]) == (ok, failed)]

        await until(lambda: counts() != [], f"{ok} broadcasts and {failed} failed", timeout_s)
        return counts()[0]

    def published(self, version: int) -> dict[str, Any]:
        return next(e for e in self.events("published") if e["version"] == version)

    async def publish(self, version: int) -> dict[str, Any]:
        """Have the trainer publish `version`; returns its event once publish() has returned."""
        Path(f"{self.port_file}.next").write_text("")
        await until(lambda: any(e["version"] == version for e in self.events("published")), f"v{version}")
        return self.published(version)

    async def watchers(self, count: int) -> None:
        async with TrainerClient(f"127.0.0.1:{self.port}") as client:
            for _ in range(int(WAIT_S * 10)):
                if (await client.status(timeout_s=10)).watchers == count:
                    return
                await asyncio.sleep(0.1)
        raise TimeoutError(f"the trainer never had {count} watchers")


async def until(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def receiving(
    port: int, receiver_id: str, applied: Applied, **kwargs: Any
) -> AsyncIterator[WeightReceiver]:
    """A receiver following the trainer in this process until the block ends."""
    async with TrainerClient(f"127.0.0.1:{port}") as client:
        receiver = WeightReceiver(client, receiver_id, applied, **kwargs)
        task = asyncio.create_task(receiver.run())
        try:
            yield receiver
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def members_at_v1(
    trainer: Trainer, port: int, tmp_path: Path, applied: Applied, member: str, other: str
) -> AsyncIterator[tuple[WeightReceiver, subprocess.Popen[bytes]]]:
    """Two broadcast members until the block ends: `member`, a receiver in this process, and
    `other`, a stand-in receiver of its own process; yielded once both hold version 1."""
    async with (
        receiving(port, member, applied) as receiver,
        server_process(
            "standin_receiver.py", tmp_path, "--trainer-port", str(port),
            "--receiver-id", other, "--big-mib", str(BIG_MIB),
        ) as (process, _),
    ):  # fmt: skip
        await until(lambda: receiver.version is not None, f"{member}'s first version")
        await trainer.watchers(2)
        await trainer.publish(1)
        await until(holds(applied, tmp_path, 1), "v1 at both members")
        yield receiver, process


def holds(applied: Applied, tmp_path: Path, version: int) -> Callable[[], bool]:
    """Whether both the in-process receiver and the one of its own process applied `version`."""
    return lambda: version in applied.versions and any(a["version"] == version for a in applied_by(tmp_path))


def applied_by(tmp_path: Path) -> list[dict[str, Any]]:
    path = Path(f"{port_file_of('standin_receiver.py', tmp_path)}.applied")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def trainer_args(timeout_s: float, big_mib: int = BIG_MIB) -> list[str]:
    # 4 MiB buckets: the standin's default 256 KiB would make a 32 MiB version 130 broadcasts.
    return ["--versions", "20", "--big-mib", str(big_mib), "--bucket-kib", "4096",
            "--broadcast-timeout", str(timeout_s)]  # fmt: skip


async def test_member_killed_mid_broadcast_is_dropped_and_training_goes_on(tmp_path: Path) -> None:
    timeout_s = 6.0
    async with server_process("standin_trainer.py", tmp_path, *trainer_args(timeout_s)) as (_, port):
        trainer = Trainer(tmp_path, port)
        applied = Applied(BIG_MIB)
        async with members_at_v1(trainer, port, tmp_path, applied, "survivor", "doomed") as (
            survivor,
            doomed,
        ):
            assert survivor.stats.broadcasts == 1

            os.kill(doomed.pid, signal.SIGSTOP)  # it stops reading its sockets: v2's broadcast waits on it
            v2 = await trainer.publish(2)
            # Training goes on: two more versions are published while v2's broadcast is held up.
            v3 = await trainer.publish(3)
            v4 = await trainer.publish(4)
            for event in (v2, v3, v4):
                assert event["time"] - event["started"] < 2.0, "publish() waited for the broadcast"
            assert v4["broadcasts"] == 1 and v4["failed_broadcasts"] == 0, "v2's broadcast was not held up"
            os.kill(doomed.pid, signal.SIGKILL)  # vanishes mid-broadcast
            failed = await trainer.broadcasts_ended(1, 1, timeout_s=timeout_s + 15)
            assert failed["time"] - v2["time"] < timeout_s + 5, "the broadcast outlived its deadline"
            doomed.wait(timeout=10)
            # The trainer let go of the failed group at once, so the survivor, still waiting on the
            # trainer for the rest of v2, learnt of the failure and fetched it, well before its own
            # receive timed out.
            await until(lambda: 2 in applied.versions, "v2 at the survivor")
            assert applied.at[2] - failed["time"] < 2.0, "the survivor waited on a group the trainer had left"

            # The survivor has v2 (whichever way it came) and v4 (fetched: the version after a
            # failure goes out fetch-only); v5 forms a group without the dead member.
            await until(lambda: survivor.version is not None and survivor.version.version == 4, "v4")
            await trainer.publish(5)
            await until(lambda: survivor.version is not None and survivor.version.version == 5, "v5")
            ended = await trainer.broadcasts_ended(2, 1)
        assert applied.mismatches == []
        assert {1, 2, 4, 5} <= set(applied.versions) and applied.versions == sorted(applied.versions)
        assert ended["rendezvous"] == 2
        assert survivor.stats.broadcasts >= 2 and survivor.stats.failed_updates == 0


async def test_member_that_never_joins_fails_one_broadcast_then_is_dropped(tmp_path: Path) -> None:
    timeout_s = 4.0
    async with server_process("standin_trainer.py", tmp_path, *trainer_args(timeout_s, big_mib=0)) as (
        _,
        port,
    ):
        trainer = Trainer(tmp_path, port)
        applied = Applied()
        ghost_notices: list[WeightNotice] = []

        async def ghost(client: TrainerClient) -> None:
            """Watches as a broadcast member but never joins a group (a firewalled or wedged server)."""
            async for notice in client.watch_weights(WatchRequest("ghost", -1, True, "")):
                ghost_notices.append(notice)

        async with (
            receiving(port, "survivor", applied) as survivor,
            TrainerClient(f"127.0.0.1:{port}") as client,
        ):
            ghost_task = asyncio.create_task(ghost(client))
            try:
                await until(lambda: survivor.version is not None and ghost_notices != [], "v0 at both")
                await trainer.watchers(2)
                v1 = await trainer.publish(1)
                v2 = await trainer.publish(2)  # while v1's rendezvous waits for the ghost
                assert v2["time"] - v2["started"] < 2.0 and v2["failed_broadcasts"] == 0
                failed = await trainer.broadcasts_ended(0, 1, timeout_s + 15)
                assert timeout_s - 0.5 < failed["time"] - v1["time"] < timeout_s + 5
                await until(lambda: survivor.version is not None and survivor.version.version == 2, "v2")
                # The ghost still watches, but the next group is formed without it.
                await trainer.publish(3)
                await until(lambda: survivor.version is not None and survivor.version.version == 3, "v3",
                            timeout_s=timeout_s + 15)  # fmt: skip
                await trainer.broadcasts_ended(1, 1, timeout_s + 15)  # and no second failure
            finally:
                ghost_task.cancel()
                await asyncio.gather(ghost_task, return_exceptions=True)
        assert applied.mismatches == [] and {1, 2, 3} <= set(applied.versions)
        assert survivor.stats.broadcasts == 1  # v3
        assert [n.version.version for n in ghost_notices if n.broadcast is not None] == [1]


async def test_member_whose_stream_ends_before_it_joins_does_not_hold_up_the_others(tmp_path: Path) -> None:
    """A member that died between two versions, its stream's end seen only after the next group
    was formed with it: the group is abandoned when the stream ends, not at the timeout."""
    timeout_s = 30.0
    async with server_process("standin_trainer.py", tmp_path, *trainer_args(timeout_s, big_mib=0)) as (
        _,
        port,
    ):
        trainer = Trainer(tmp_path, port)
        applied = Applied()
        rendezvous = asyncio.Event()

        async def ghost(client: TrainerClient) -> None:
            """Watches as a broadcast member; never joins the group its first notice names."""
            async for notice in client.watch_weights(WatchRequest("ghost", -1, True, "")):
                if notice.broadcast is not None:
                    rendezvous.set()

        async with (
            receiving(port, "survivor", applied) as survivor,
            TrainerClient(f"127.0.0.1:{port}") as client,
        ):
            ghost_task = asyncio.create_task(ghost(client))
            try:
                await trainer.watchers(2)
                v1 = await trainer.publish(1)
                await asyncio.wait_for(rendezvous.wait(), WAIT_S)
                await asyncio.sleep(1.0)  # the survivor waits at the rendezvous
                assert 1 not in applied.versions
                ghost_task.cancel()  # its stream ends
                await asyncio.gather(ghost_task, return_exceptions=True)
                failed = await trainer.broadcasts_ended(0, 1, timeout_s=10)
                assert failed["time"] - v1["time"] < 10, "the group waited for a member that was gone"
                await until(lambda: 1 in applied.versions, "v1 at the survivor", timeout_s=10)
                await trainer.watchers(1)
                await trainer.publish(2)  # fetch-only: the version after a failure
                await trainer.publish(3)  # a group of the survivor alone
                await until(lambda: 3 in applied.versions, "v3 at the survivor", timeout_s=10)
                await trainer.broadcasts_ended(1, 1, timeout_s=10)
            finally:
                ghost_task.cancel()
                await asyncio.gather(ghost_task, return_exceptions=True)
        assert applied.mismatches == [] and {1, 2, 3} <= set(applied.versions)
        assert survivor.stats.fetch_fallbacks == 1 and survivor.stats.broadcasts == 1


async def test_joiner_does_not_hold_up_a_broadcast_in_progress(tmp_path: Path) -> None:
    timeout_s = 30.0
    held_s = 3.0
    async with server_process("standin_trainer.py", tmp_path, *trainer_args(timeout_s)) as (_, port):
        trainer = Trainer(tmp_path, port)
        applied, joined = Applied(BIG_MIB), Applied(BIG_MIB)
        async with members_at_v1(trainer, port, tmp_path, applied, "member", "slow") as (member, slow):
            os.kill(slow.pid, signal.SIGSTOP)  # v2's broadcast is in progress until it goes on
            try:
                v2 = await trainer.publish(2)
                async with receiving(port, "joiner", joined) as joiner:
                    await until(lambda: 2 in joined.versions, "the joiner's first version")
                    assert trainer.events("broadcast_ended")[-1]["broadcasts"] == 1, "v2's broadcast ended"
                    assert joiner.stats.fetches == 1 and joiner.stats.broadcasts == 0
                    await asyncio.sleep(max(0.0, v2["time"] + held_s - time.time()))
                    os.kill(slow.pid, signal.SIGCONT)
                    ended = await trainer.broadcasts_ended(2, 0)
                    # The broadcast in progress ended once its slow member went on, not at the deadline.
                    assert ended["time"] - v2["time"] < held_s + 8
                    await until(holds(applied, tmp_path, 2), "v2 at both members")
                    assert member.stats.broadcasts == 2

                    # The joiner is a member from the next version on.
                    await trainer.publish(3)
                    await until(holds(applied, tmp_path, 3), "v3 at both members")
                    await until(lambda: 3 in joined.versions, "v3 at the joiner")
                    assert joiner.stats.broadcasts == 1
                    ended = await trainer.broadcasts_ended(3, 0)
            finally:
                os.kill(slow.pid, signal.SIGCONT)
        received = applied_by(tmp_path)
        assert all(a["ok"] for a in received) and [a["version"] for a in received][-2:] == [2, 3]
        assert applied.mismatches == [] and joined.mismatches == []
        assert ended["rendezvous"] == 2
