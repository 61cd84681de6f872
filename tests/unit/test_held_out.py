"""Held-out evaluation sets that training never draws (built-in tasks, environment episodes, a
file's `eval_split` rows), and a file's epochs: each a new order, resumable at any problem."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.coordinator.datasets import (
    ENVIRONMENT,
    episode_seeds,
    evaluation_problems,
    held_out_episode_seeds,
    open_problems,
)
from pipelinerl.coordinator.tasks import TASKS, Problem, Task, held_out


def evaluate(name: str, *, run_dataset: str = "", seed: int = 0, eval_split: float = 0.0, limit: int = 0):
    return evaluation_problems(
        name, run_dataset=run_dataset, seed=seed, eval_split=eval_split, tokenizer=None, limit=limit
    )


def training(dataset: str, seed: int, n: int | None = None, **kwargs) -> list:
    return list(itertools.islice(open_problems(dataset, seed, **kwargs), n))


@pytest.mark.parametrize(("dataset", "count"), [("builtin:copy:2", 11), ("builtin:repeat", 147)])
def test_builtin_held_out_problems_are_never_trained_on_and_the_same_for_every_run(
    dataset: str, count: int
) -> None:
    held = evaluate(dataset)
    assert len(held) == count == len({p.prompt for p in held})  # all of them, fewer than 256
    assert evaluate(dataset, seed=7) == held
    assert evaluate(dataset, limit=5) == held[:5]
    for seed in (0, 1):
        trained = {p.prompt for _, p in training(dataset, seed, 20_000)}
        assert not trained & {p.prompt for p in held}
    if dataset == "builtin:copy:2":  # a small space: training draws every other prompt
        assert len(trained) == 100 - count
    assert all(p.answer == p.prompt.removesuffix("=") for p in held)


def test_a_held_out_prompt_is_held_out_of_every_task_that_shares_it() -> None:
    copy = {p.prompt for p in evaluate("builtin:copy:2")}
    assert {p.prompt for p in evaluate("builtin:reverse:2")} == copy
    assert not copy & {p.prompt for _, p in training("builtin:sort:2", 3, 5_000)}


def test_environment_held_out_seeds_are_never_played_in_training() -> None:
    held = evaluate("environment:guess_number")
    assert len(held) == 256 and all(p == Problem(p.prompt, "", ENVIRONMENT) for p in held)
    assert [int(p.prompt) for p in held] == held_out_episode_seeds(256)
    assert evaluate("environment:guess_number", seed=9, limit=3) == held[:3]
    trained = set(itertools.islice(episode_seeds(0), 20_000))
    assert not trained & {int(p.prompt) for p in held}
    assert not any(held_out(str(s)) for s in trained)
    assert [p.prompt for _, p in training("", 0, 5)] == [
        str(s) for s in itertools.islice(episode_seeds(0), 5)
    ]


@pytest.fixture
def rows_file(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(40)))
    return path


def test_eval_split_rows_are_never_trained_on_in_any_epoch(rows_file: Path) -> None:
    dataset = str(rows_file)
    held = evaluate(dataset, run_dataset=dataset, seed=3, eval_split=0.25)
    assert len(held) == 10
    run = training(dataset, 3, epochs=3, eval_split=0.25)
    assert [i for i, _ in run] == list(range(90))  # three passes of 30, then the run ends
    passes = [[p.prompt for _, p in run[e * 30 : (e + 1) * 30]] for e in range(3)]
    kept = {f"p{i}" for i in range(40)} - {p.prompt for p in held}
    assert all(sorted(order) == sorted(kept) for order in passes)  # each pass: every training row once
    assert passes[0] != passes[1] != passes[2]
    # the split is the run's seed's: another seed holds out other rows, the same seed the same ones
    assert evaluate(dataset, run_dataset=dataset, seed=3, eval_split=0.25) == held
    assert evaluate(dataset, run_dataset=dataset, seed=4, eval_split=0.25) != held
    assert evaluate(dataset, run_dataset=dataset, seed=3, eval_split=0.25, limit=4) == held[:4]
    # a larger split only moves rows from training to held out
    assert {p.prompt for p in held} < {
        p.prompt for p in evaluate(dataset, run_dataset=dataset, seed=3, eval_split=0.5)
    }


@pytest.mark.parametrize("start", [0, 17, 29, 30, 31, 59, 89, 90])
def test_a_resumed_run_continues_at_its_pass_and_position(rows_file: Path, start: int) -> None:
    whole = training(str(rows_file), 5, epochs=3, eval_split=0.25)
    assert training(str(rows_file), 5, start=start, epochs=3, eval_split=0.25) == whole[start:]


def test_one_epoch_without_a_split_trains_on_every_row_once(rows_file: Path) -> None:
    run = training(str(rows_file), 0)
    assert sorted(p.prompt for _, p in run) == sorted(f"p{i}" for i in range(40))


def test_another_file_is_evaluated_whole_and_the_runs_own_by_its_resolved_path(
    rows_file: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(5)))
    assert [p.prompt for p in evaluate(str(other), run_dataset=str(rows_file))] == [f"q{i}" for i in range(5)]
    assert len(evaluate(str(other), run_dataset="builtin:copy:2", limit=2)) == 2
    spelled = str(tmp_path / ".." / tmp_path.name / "rows.jsonl")
    assert len(evaluate(spelled, run_dataset=str(rows_file), eval_split=0.1)) == 4


def test_bad_evaluation_sets_name_the_field(rows_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(name: str, **kwargs) -> str:
        with pytest.raises(InvalidArgument) as exc:
            evaluate(name, **kwargs)
        assert exc.value.violations[0].field == "spec.evaluations"
        return exc.value.violations[0].description

    assert "builtin:<copy|" in refused("builtin:nope")
    assert "must be 1 to 32" in refused("builtin:copy:0")
    assert "environment:<name>" in refused("environment:")
    assert ".jsonl/.parquet" in refused("data.csv")
    assert "no such file" in refused("missing.jsonl")
    dataset = str(rows_file)
    assert "eval_split is 0" in refused(dataset, run_dataset=dataset)
    assert "holds out no row" in refused(dataset, run_dataset=dataset, eval_split=0.01)
    monkeypatch.setitem(TASKS, "one", Task(lambda rng, size: ("p0=", "p0"), range(1, 2), 1, "size"))
    assert not held_out("p0=")
    assert refused("builtin:one") == "builtin:one:1 has no held-out problems"
