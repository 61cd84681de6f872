"""The long-tail built-in task `builtin:repeat`: problems reproducible by seed, lengths set by the
answer, scored by the `digits_strict` verifier (partial credit, filler costs credit, 1.0 only when
exact), bad sizes refused."""

from __future__ import annotations

import itertools
import statistics

import pytest

from benchmarks.pipeline_vs_sync import round_spread
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.coordinator.datasets import open_problems
from pipelinerl.coordinator.tasks import max_new_tokens, parse_builtin
from pipelinerl.launcher.checks import check_run
from pipelinerl.launcher.config import RunSettings
from pipelinerl.reward.types import ScoreItem
from pipelinerl.reward.verifiers import RewardFunction, RewardSpec, StrictDigitsVerifier


def problems(dataset: str, seed: int, n: int, start: int = 0) -> list:
    return [p for _, p in itertools.islice(open_problems(dataset, seed=seed, start=start), n)]


def test_problems_are_reproducible_by_seed_and_resume_from_a_cursor() -> None:
    first = problems("builtin:repeat", seed=3, n=50)
    assert problems("builtin:repeat", seed=3, n=50) == first
    assert problems("builtin:repeat", seed=3, n=10, start=40) == first[40:]
    assert problems("builtin:repeat", seed=4, n=50) != first


def test_the_answer_repeats_the_digit_count_times_and_its_length_is_heavy_tailed() -> None:
    drawn = problems("builtin:repeat", seed=0, n=20_000)
    for problem in drawn[:200]:
        digits = problem.prompt.removesuffix("=")
        assert problem.answer == digits == digits[0] * len(digits)
        assert problem.verifier == "digits_strict"
    # a completion is the answer plus end-of-sequence: 2 to 129 tokens
    lengths = sorted(len(p.answer) + 1 for p in drawn)
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert lengths[0] == 2 and lengths[-1] == 129
    assert p99 / median >= 8 and statistics.fmean(lengths) >= 16
    # and within a round of the default run, 16 prompts of 8 attempts each, as the benchmark measures it
    rounds = [len(p.answer) + 1 for p in drawn[:16_000] for _ in range(8)]
    spread = round_spread(rounds, round_size=128)
    assert spread is not None and spread >= 8
    assert len({p.answer[0] for p in drawn[:200]}) == 10
    assert max(len(p.answer) for p in problems("builtin:repeat:32", seed=0, n=2000)) == 32


def test_a_run_on_it_allows_its_longest_answer() -> None:
    assert max_new_tokens("builtin:repeat") == 129 and max_new_tokens("builtin:copy:2") == 3
    assert RunSettings(dataset="builtin:repeat").completion_tokens == 129
    assert RunSettings(dataset="builtin:repeat:300").completion_tokens == 301
    assert RunSettings(dataset="builtin:repeat", max_new_tokens=40).completion_tokens == 40
    assert RunSettings().completion_tokens == 3  # builtin:copy:2, as before


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("7" * 40, 1.0),  # exact
        ("7" * 20, 0.5),  # right digit, half the length
        ("7" * 80, 0.5),  # twice the length: the extra digits earn nothing
        ("7" * 30 + "1" * 10, 0.75),
        ("7a" * 20, 0.5),  # 20 right digits among filler, 40 characters
        ("7a" * 40, 0.5),  # 40 right digits, 80 characters: the filler costs what it is long
        ("3" * 40, 0.0),
        ("", 0.0),
    ],
)
def test_partial_credit_per_digit_and_full_credit_only_when_exact(completion: str, expected: float) -> None:
    score, _ = StrictDigitsVerifier().score("7" * 40 + "=", completion, "7" * 40)
    assert score == pytest.approx(expected)


def test_the_reward_service_scores_it_by_name_with_exact_correctness() -> None:
    reward = RewardFunction(RewardSpec())
    exact, details = reward.score(ScoreItem("s", "777=", "777", "777", "digits_strict"))
    assert exact == 1.0 and details[0].verifier == "digits_strict" and details[0].score == 1.0
    partial, details = reward.score(ScoreItem("s", "777=", "77x", "777", "digits_strict"))
    assert partial == pytest.approx(2 / 3) and details[0].score < 1.0


@pytest.mark.parametrize(
    "dataset",
    ["builtin:repeat:7", "builtin:repeat:513", "builtin:repeat:x", "builtin:repeat:", "builtin:repeat:1:2"],
)
def test_bad_sizes_are_refused_naming_the_dataset(dataset: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        parse_builtin(dataset)
    assert exc.value.violations[0].field == "spec.dataset"
    with pytest.raises(InvalidArgument, match="dataset: "):
        check_run(RunSettings(dataset=dataset))


def test_the_other_tasks_keep_their_streams_and_limits() -> None:
    assert [p.prompt for p in problems("builtin:copy:2", seed=0, n=3)] == ["66=", "04=", "87="]
    with pytest.raises(InvalidArgument, match="1 to 32"):
        parse_builtin("builtin:copy:33")
