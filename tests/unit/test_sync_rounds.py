"""Sync mode's rounds, driven by the run loop against in-process fakes: a round reaches the trainer
only once all of it is generated and scored, so a round of several steps' samples (the conventional
variant) is trained by several steps in a row on the one version that generated it; pipeline mode
sends each group on as soon as it is scored."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest

from pipelinerl.common.types import FinishReason, Sample, TokenSequence
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.loop import RunLoop
from pipelinerl.coordinator.tasks import builtin_problems
from pipelinerl.coordinator.types import Mode, RunSpec
from pipelinerl.inference.types import Completion, GenerationRequest
from pipelinerl.reward.types import ScoreItem, ScoreResult, VerifierDetail
from pipelinerl.trainer.types import Disposition, SampleAck

STEP = 4  # samples per optimizer step of the fake trainer


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []  # ("generated" | "sent", sample id), in order


class FakePool:
    """Generates with the served version; the last group of each round is the slow one."""

    def __init__(self, events: Events, trainer: FakeTrainer) -> None:
        self.events, self.trainer = events, trainer
        self.waited_for: list[int] = []

    async def generate(self, request: GenerationRequest) -> tuple[str, Completion]:
        index = int(request.request_id.split("-p")[1].split("-")[0])
        await asyncio.sleep(0.05 if index % 2 else 0.001)  # a long and a short generation
        version = self.trainer.version
        tokens = TokenSequence([5, 6], [-0.1, -0.2], [version, version])
        self.events.log.append(("generated", request.request_id))
        return "fake:1", Completion(request.request_id, [1], tokens, "56", FinishReason.STOP)

    async def wait_for_version(self, version: int) -> None:
        self.waited_for.append(version)

    def snapshot(self) -> list[tuple[str, int, int]]:
        return []


class FakeReward:
    async def score(self, items: Sequence[ScoreItem], timeout_s: float) -> list[ScoreResult]:
        return [ScoreResult(i.sample_id, 0.5, [VerifierDetail("digits", 0.5, 1.0, "")]) for i in items]


class FakeTrainer:
    """Takes a step of STEP samples as soon as it holds them (a flush trains what it holds)."""

    def __init__(self, events: Events) -> None:
        self.events = events
        self.version = 0
        self.latest_version = 0
        self.held: list[tuple[Sample, asyncio.Future[SampleAck]]] = []
        self.lags: dict[str, int] = {}

    def send(
        self, samples: Sequence[Sample], on_retracted: object = None
    ) -> dict[str, asyncio.Future[SampleAck]]:
        futures = {}
        for sample in samples:
            self.events.log.append(("sent", sample.sample_id))
            future: asyncio.Future[SampleAck] = asyncio.get_running_loop().create_future()
            self.held.append((sample, future))
            futures[sample.sample_id] = future
        while len(self.held) >= STEP:
            self._step(STEP)
        return futures

    def flush(self, checkpoint: bool = False) -> None:
        if self.held:
            self._step(len(self.held))

    def _step(self, n: int) -> None:
        step, self.held = self.held[:n], self.held[n:]
        for sample, _ in step:
            self.lags[sample.sample_id] = self.version - sample.completion.versions[0]
        self.version += 1
        self.latest_version = self.version
        for sample, future in step:
            future.set_result(SampleAck(sample.sample_id, Disposition.TRAINED, self.version))

    def keep(self, trained: object, on_retracted: object = None) -> None:
        pass

    async def settle(self) -> None:
        pass


def run_loop(tmp_path: Path, mode: Mode, round_samples: int) -> tuple[Events, FakeTrainer, FakePool]:
    events = Events()
    trainer = FakeTrainer(events)
    pool = FakePool(events, trainer)
    journal = Journal(tmp_path / "journal.sqlite")
    spec = RunSpec("builtin:copy:2", group_size=2, max_samples=16, mode=mode, max_in_flight=round_samples)
    journal.create_run("r", {"dataset": spec.dataset})
    problems = enumerate(builtin_problems("copy", 2, seed=0))
    loop = RunLoop("r", spec, journal, pool, FakeReward(), trainer, problems)  # type: ignore[arg-type]
    asyncio.run(asyncio.wait_for(loop.run(), 30))
    journal.close()
    return events, trainer, pool


def rounds_of(events: Events, size: int) -> list[list[tuple[str, str]]]:
    def round_index(event: tuple[str, str]) -> int:
        return int(event[1].split("-p")[1].split("-")[0]) * 2 // size

    ordered = sorted(enumerate(events.log), key=lambda e: (round_index(e[1]), e[0]))
    return [[e for _, e in group] for _, group in itertools.groupby(ordered, key=lambda e: round_index(e[1]))]


@pytest.mark.parametrize("steps_per_round", [1, 2])
def test_a_sync_round_is_trained_only_once_all_of_it_is_generated(
    tmp_path: Path, steps_per_round: int
) -> None:
    size = STEP * steps_per_round
    events, trainer, pool = run_loop(tmp_path, Mode.SYNC, size)
    assert len(trainer.lags) == 16
    for round_events in rounds_of(events, size):
        kinds = [kind for kind, _ in round_events]
        assert kinds == ["generated"] * size + ["sent"] * size, kinds
    # every round is generated with one version and trained by `steps_per_round` steps in a row:
    # the k-th step of a round trains samples k - 1 versions old
    lags = sorted(trainer.lags.values())
    assert lags == sorted(list(range(steps_per_round)) * (16 // steps_per_round))
    assert pool.waited_for == [steps_per_round * (r + 1) for r in range(16 // size)]


def test_pipeline_mode_sends_a_group_on_while_others_still_generate(tmp_path: Path) -> None:
    events, trainer, _ = run_loop(tmp_path, Mode.PIPELINE, 8)
    assert len(trainer.lags) == 16
    first_sent = next(i for i, (kind, _) in enumerate(events.log) if kind == "sent")
    assert any(kind == "generated" for kind, _ in events.log[first_sent:])
