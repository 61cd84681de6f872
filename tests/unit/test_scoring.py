"""The scorer's worker pool: results in order, per-item errors, and timeouts and crashes it survives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipelinerl.common.errors import InvalidArgument, Unavailable
from pipelinerl.reward.scoring import Scorer, WorkerStartError
from pipelinerl.reward.types import ScoreItem
from pipelinerl.reward.verifiers import RewardSpec

TIMEOUT_S = 1.0

# A user verifier whose behaviour the completion picks, so one scorer covers every failure path.
MISBEHAVING_VERIFIER = """
import os
import time


def score(prompt, completion, answer):
    if completion == "hang":
        while True:
            time.sleep(60)
    if completion == "exit":
        os._exit(3)
    if completion == "raise":
        raise RuntimeError("boom")
    return float(completion == answer)
"""


@pytest.fixture(scope="module")
def scorer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scorer]:
    path = tmp_path_factory.mktemp("verifier") / "misbehaving.py"
    path.write_text(MISBEHAVING_VERIFIER)
    spec = RewardSpec(python_function=f"{path}:score", max_completion_chars=1000)
    scorer = Scorer(spec, workers=2, timeout_s=TIMEOUT_S)
    yield scorer
    scorer.close()


def python_item(sample_id: str, completion: str, answer: str = "ok") -> ScoreItem:
    return ScoreItem(sample_id, "prompt", completion, answer, "python")


async def test_scores_math_items_in_request_order(scorer: Scorer) -> None:
    items = [
        ScoreItem("right", "1/2 as a decimal?", r"It is \boxed{0.5}", r"\frac{1}{2}", "math"),
        ScoreItem("wrong", "1/2 as a decimal?", r"It is \boxed{0.2}", r"\frac{1}{2}", "math"),
        ScoreItem("digits", "Copy 1234", "1294", "1234", "digits"),
    ]
    results = await scorer.score(items)
    assert [result.sample_id for result in results] == ["right", "wrong", "digits"]
    assert [result.reward for result in results] == [1.0, 0.0, 0.75]
    assert all(result.error is None for result in results)
    assert results[0].details[0].verifier == "math"


async def test_a_hanging_verifier_times_out_alone(scorer: Scorer) -> None:
    before = scorer.stats
    items = [
        python_item("a", "ok"),
        python_item("stuck", "hang"),
        python_item("b", "ok"),
        python_item("c", ""),
    ]
    started = time.monotonic()
    results = await scorer.score(items)
    elapsed = time.monotonic() - started

    stuck = results[1]
    assert stuck.timed_out and stuck.reward is None
    assert stuck.error is not None and stuck.error.code == "DEADLINE_EXCEEDED"
    assert "stuck" in stuck.error.message
    assert [results[i].reward for i in (0, 2, 3)] == [1.0, 1.0, 0.0]
    assert elapsed < TIMEOUT_S + 2.0

    # The killed worker is replaced, and the next batch is scored in full.
    again = await scorer.score([python_item(f"next-{i}", "ok") for i in range(4)])
    assert [result.reward for result in again] == [1.0] * 4
    after = scorer.stats
    assert after.timed_out == before.timed_out + 1
    assert after.worker_restarts == before.worker_restarts + 1
    assert after.scored == before.scored + 7


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("exit", "exited with code 3"), ("raise", "RuntimeError: boom")],
)
async def test_a_crash_fails_only_its_item(scorer: Scorer, completion: str, expected: str) -> None:
    before = scorer.stats
    items = [python_item("x", "ok"), python_item("crash", completion), python_item("y", "ok")]
    results = await scorer.score(items)
    error = results[1].error
    assert error is not None and error.code == "INTERNAL" and not results[1].timed_out
    assert expected in error.message
    assert [results[0].reward, results[2].reward] == [1.0, 1.0]

    again = await scorer.score([python_item(f"next-{i}", "ok") for i in range(3)])
    assert all(result.reward == 1.0 for result in again)
    assert scorer.stats.failed == before.failed + 1


async def test_bad_items_are_rejected_by_field_and_the_rest_scored(scorer: Scorer) -> None:
    items = [
        ScoreItem("unknown", "p", "4", "4", "astrology"),
        ScoreItem("no-answer", "p", r"\boxed{4}", " ", "math"),
        ScoreItem("too-long", "p", "4" * 1001, "4", "exact"),
        ScoreItem("fine", "p", r"\boxed{4}", "4", "exact"),
        ScoreItem("not-a-number", "p", "4", "four", "numeric"),
    ]
    results = await scorer.score(items)
    fields = [result.error.violations[0].field if result.error else None for result in results]
    assert fields == ["items[0].verifier", "items[1].answer", "items[2].completion", None, "items[4].answer"]
    for result in (results[0], results[1], results[2], results[4]):
        assert result.error is not None and result.error.code == "INVALID_ARGUMENT"
        assert result.sample_id in result.error.message
    assert results[3].reward == 1.0


@pytest.mark.parametrize(
    ("sample_ids", "field"),
    [([], "items"), (["a", "b", "a"], "items[2].sample_id")],
)
async def test_a_malformed_batch_fails_as_a_whole(scorer: Scorer, sample_ids: list[str], field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        await scorer.score([python_item(sample_id, "ok") for sample_id in sample_ids])
    assert caught.value.violations[0].field == field


def test_lists_the_configured_verifiers(scorer: Scorer) -> None:
    names = [info.name for info in scorer.list_verifiers()]
    assert names == ["digits", "digits_strict", "exact", "format", "math", "numeric", "python"]


def test_a_verifier_that_cannot_load_fails_at_start(tmp_path: Path) -> None:
    spec = RewardSpec(python_function=f"{tmp_path / 'missing.py'}:score")
    with pytest.raises(WorkerStartError, match=r"missing\.py"):
        Scorer(spec, workers=1)


async def test_a_closed_scorer_refuses_work() -> None:
    scorer = Scorer(RewardSpec(), workers=1)
    scorer.close()
    with pytest.raises(Unavailable):
        await scorer.score([ScoreItem("a", "p", "1", "1", "exact")])
