"""Held-out evaluation's arithmetic and schedule: pass@k, the figures of one evaluation, when each
set is due, and what the journal keeps across a restart."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.coordinator.eval_schedule import EvaluationSchedule
from pipelinerl.coordinator.evaluation import Evaluator, Outcome, pass_at_k, summarize
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.tasks import Problem
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec


def _pass_at_k_by_enumeration(n: int, c: int, k: int) -> float:
    """The probability that k completions drawn without replacement from n hold a correct one."""
    completions = [True] * c + [False] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return sum(any(completions[i] for i in draw) for draw in draws) / len(draws)


@pytest.mark.parametrize(("n", "c", "k"), [(5, 0, 1), (5, 2, 1), (5, 2, 3), (6, 1, 6), (8, 3, 4), (4, 4, 2)])
def test_pass_at_k_is_the_probability_that_k_of_n_completions_hold_a_correct_one(
    n: int, c: int, k: int
) -> None:
    assert math.isclose(pass_at_k(n, c, k), _pass_at_k_by_enumeration(n, c, k))


def test_pass_at_1_is_the_fraction_correct_and_bad_counts_are_refused() -> None:
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(2, 1, 3)


def test_an_evaluation_reports_reward_pass_at_1_pass_at_k_length_and_truncations() -> None:
    right, wrong, cut = (
        Outcome(1.0, True, 3, False),
        Outcome(0.25, False, 5, False),
        Outcome(0.0, False, 8, True),
    )
    result = summarize("builtin:copy", 7, [[right, wrong], [wrong, cut], [right, right]], 1.5, "a:1")
    assert (result.dataset, result.weight_version, result.problems, result.samples_per_problem) == (
        "builtin:copy", 7, 3, 2,
    )  # fmt: skip
    assert result.reward_mean == pytest.approx((1 + 0.25 + 0.25 + 0 + 1 + 1) / 6)
    assert result.pass_at_1 == pytest.approx(3 / 6)
    assert result.pass_at_k == pytest.approx(2 / 3)  # two of three problems have a correct completion
    assert result.completion_tokens_mean == pytest.approx((3 + 5 + 5 + 8 + 3 + 3) / 6)
    assert result.truncated_fraction == pytest.approx(1 / 6)


class _FakeEvaluator(Evaluator):
    """Evaluates at the trainer's version as it is, or fails when told to."""

    def __init__(self, version: list[int], fail: set[int] | None = None) -> None:
        self._version, self._fail, self.calls = version, fail or set(), []

    async def evaluate(
        self, spec: EvaluationSpec, problems: Sequence[Problem], at_least: int = 0, label: str = "eval"
    ) -> EvaluationResult:
        held = self._version[0]
        assert held >= at_least
        self.calls.append((spec.dataset, at_least, held))
        if held in self._fail:
            raise FailedPrecondition("moved on")
        return EvaluationResult(spec.dataset, held, len(problems), 1, 0.5, 0.5, 0.5, 3.0, 0.0,
                                datetime.now(UTC), 0.1, "a:1")  # fmt: skip


async def _follow_versions(schedule: EvaluationSchedule, version: list[int], upto: int) -> None:
    task = asyncio.create_task(schedule.follow())
    for v in range(upto + 1):
        version[0] = v
        await asyncio.sleep(0.03)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_sets_are_evaluated_first_every_n_versions_and_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pipelinerl.coordinator.eval_schedule.POLL_S", 0.005)
    version = [0]
    evaluator = _FakeEvaluator(version)
    journal = Journal(tmp_path / "j.sqlite")
    sets = [(EvaluationSpec("builtin:copy", every_versions=4), [Problem("1=", "1", "digits")]),
            (EvaluationSpec("builtin:sort", every_versions=5), [Problem("21=", "12", "digits")])]  # fmt: skip
    schedule = EvaluationSchedule("run", sets, evaluator, journal, lambda: version[0])
    await _follow_versions(schedule, version, 11)
    version[0] = 13
    await schedule.finish()
    evaluated = [(r.dataset, r.weight_version) for r in schedule.results]
    assert [v for d, v in evaluated if d == "builtin:copy"] == [0, 4, 8, 13]
    assert [v for d, v in evaluated if d == "builtin:sort"] == [0, 5, 10, 13]
    # the journal holds them whole, and a restarted run goes on from them (nothing evaluated twice)
    restarted = EvaluationSchedule("run", sets, _FakeEvaluator(version), Journal(tmp_path / "j.sqlite"),
                                   lambda: version[0])  # fmt: skip
    assert [(r.dataset, r.weight_version) for r in restarted.results] == evaluated
    await restarted.finish()
    assert restarted.results == schedule.results


@pytest.mark.asyncio
async def test_a_failed_evaluation_is_tried_again_and_never_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pipelinerl.coordinator.eval_schedule.POLL_S", 0.005)
    monkeypatch.setattr("pipelinerl.coordinator.eval_schedule.FAILED_RETRY_S", 0.01)
    version = [0]
    evaluator = _FakeEvaluator(version, fail={0})
    journal = Journal(tmp_path / "j.sqlite")
    spec = EvaluationSpec("builtin:copy", every_versions=100)
    schedule = EvaluationSchedule("run", [(spec, [Problem("1=", "1", "digits")])], evaluator, journal,
                                  lambda: version[0])  # fmt: skip
    await _follow_versions(schedule, version, 2)
    assert [r.weight_version for r in schedule.results] == [1]  # version 0 failed, then 1 was first
    assert len([c for c in evaluator.calls if c[2] == 0]) >= 2
    assert [r.weight_version for r in journal.evaluations("run")] == [1]


def test_journaled_evaluations_read_back_equal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.sqlite")
    rng = random.Random(0)
    results = [
        EvaluationResult(f"set{i % 2}", i, 10, 4, rng.random(), rng.random(), rng.random(), 3.5, 0.1,
                         datetime.now(UTC), 2.25, "127.0.0.1:1")
        for i in range(4)
    ]  # fmt: skip
    for result in results:
        journal.add_evaluation("run", result)
    journal.add_evaluation("other", results[0])
    assert Journal(tmp_path / "j.sqlite").evaluations("run") == results
