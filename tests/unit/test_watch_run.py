"""WatchRun on the coordinator core, against in-process fakes: the last message a watcher gets is
the run's final state (completed, stopped or failed), even when the run ends while the watcher
is slow to read, and it comes as the run ends, not at the next progress update."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from pipelinerl.common.types import FinishReason, Sample, TokenSequence
from pipelinerl.coordinator import coordinator as coordinator_module
from pipelinerl.coordinator.coordinator import Coordinator
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.pool import ServerLimits
from pipelinerl.coordinator.types import RunSpec, RunState
from pipelinerl.inference.types import Completion, GenerationRequest
from pipelinerl.reward.types import ScoreItem, ScoreResult, VerifierDetail
from pipelinerl.trainer.types import Disposition, SampleAck

SPEC = RunSpec("builtin:copy:2", group_size=2, max_samples=8, max_in_flight=4)


class FakePool:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    async def limits(self, timeout_s: float) -> ServerLimits:
        return ServerLimits(max_new_tokens=64, max_context=128)

    async def generate(self, request: GenerationRequest) -> tuple[str, Completion]:
        await asyncio.sleep(0.001)
        if self.fail:
            raise RuntimeError("the engine broke")
        tokens = TokenSequence([5, 6], [-0.1, -0.2], [0, 0])
        return "fake:1", Completion(request.request_id, [1], tokens, "56", FinishReason.STOP)

    def snapshot(self) -> list[tuple[str, int, int]]:
        return []


class FakeReward:
    async def score(self, items: Sequence[ScoreItem], timeout_s: float) -> list[ScoreResult]:
        return [ScoreResult(i.sample_id, 1.0, [VerifierDetail("copy", 1.0, 1.0, "")]) for i in items]


class FakeTrainer:
    """Trains every sample as it arrives."""

    latest_version = 0

    def send(
        self, samples: Sequence[Sample], on_retracted: object = None
    ) -> dict[str, asyncio.Future[SampleAck]]:
        futures = {}
        for sample in samples:
            futures[sample.sample_id] = future = asyncio.get_running_loop().create_future()
            future.set_result(SampleAck(sample.sample_id, Disposition.TRAINED, 1))
        return futures

    def flush(self, checkpoint: bool = False) -> None:
        pass

    def keep(self, trained: object, on_retracted: object = None) -> None:
        pass

    async def settle(self) -> None:
        pass


def coordinator(tmp_path: Path, pool: FakePool | None = None) -> Coordinator:
    journal = Journal(tmp_path / "journal.sqlite")
    return Coordinator(journal, pool or FakePool(), FakeReward(), FakeTrainer())  # type: ignore[arg-type]


async def until_ended(core: Coordinator, run_id: str) -> None:
    while not core.get_run(run_id).state.final:
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(("fail", "end"), [(False, RunState.COMPLETED), (True, RunState.FAILED)])
async def test_a_watcher_slow_to_read_still_sees_the_run_end(
    tmp_path: Path, fail: bool, end: RunState
) -> None:
    core = coordinator(tmp_path, FakePool(fail))
    await core.start_run("r", SPEC)
    watch = core.watch_run("r")
    assert (await anext(watch)).state is RunState.RUNNING
    await asyncio.wait_for(until_ended(core, "r"), 30)  # the run ends while the watcher is not reading
    rest = [info async for info in watch]
    assert [info.state for info in rest[-1:]] == [end]
    if end is RunState.COMPLETED:
        assert rest[-1].progress.trained == SPEC.max_samples


async def test_a_watcher_slow_to_read_sees_a_stopped_run_stopped(tmp_path: Path) -> None:
    core = coordinator(tmp_path)
    await core.start_run("r", RunSpec("builtin:copy:2", group_size=2, max_in_flight=4))  # no budget
    watch = core.watch_run("r")
    assert (await anext(watch)).state is RunState.RUNNING
    assert (await asyncio.wait_for(core.stop_run("r"), 30)).state is RunState.STOPPED
    assert [info.state async for info in watch][-1:] == [RunState.STOPPED]


async def test_the_end_reaches_a_watcher_as_the_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coordinator_module, "WATCH_EVERY_S", 60.0)  # no progress update comes meanwhile
    core = coordinator(tmp_path)
    await core.start_run("r", SPEC)
    states = await asyncio.wait_for(_states(core, "r"), 10)
    assert states[0] is RunState.RUNNING and states[-1] is RunState.COMPLETED


async def _states(core: Coordinator, run_id: str) -> list[RunState]:
    return [info.state async for info in core.watch_run(run_id)]
