"""A run ends when its budget is trained, whatever the trainer's step size: the last, partial step
is trained on a flush and checkpointed (before, a run of 18 samples in steps of 4 stayed RUNNING at
16, and a sync round smaller than a step never trained)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import launch
from tests.e2e.evidence import assert_trained_exactly_once

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("mode", "group_size"), [("pipeline", 2), ("sync", 3)], ids=["pipeline", "sync-round-under-a-step"]
)
async def test_a_budget_that_is_not_a_multiple_of_the_step_is_trained_to_the_end(
    tmp_path: Path, mode: str, group_size: int
) -> None:
    settings = RunSettings(
        run_dir=tmp_path / "run", mode=mode, max_samples=18, samples_per_step=4, group_size=group_size,
        max_in_flight=8, duration_s=120,
    )  # fmt: skip
    result = await launch(settings)
    assert result.state == "completed" and result.trained == 18, result
    assert assert_trained_exactly_once(settings.run_dir, 18) == {"trained": 18}


async def test_a_conventional_round_of_two_steps_on_the_long_tail_task(tmp_path: Path) -> None:
    """`--mode sync --round-steps 2` on `builtin:repeat`: each round of two steps' samples is
    generated with one version and trained by two steps in a row, so half the samples are one
    version old. `max_new_tokens` is the dataset's own (17) by default."""
    settings = RunSettings(
        run_dir=tmp_path / "run", mode="sync", round_steps=2, dataset="builtin:repeat:16", max_samples=16,
        samples_per_step=4, group_size=2, duration_s=120,
    )  # fmt: skip
    result = await launch(settings)
    assert result.state == "completed" and result.trained == 16, result
    assert assert_trained_exactly_once(settings.run_dir, 16) == {"trained": 16}
    steps = [
        json.loads(line) for line in (settings.run_dir / "trainer_metrics.jsonl").read_text().splitlines()
    ]
    # each round's first step trains tokens of the version it trains (lag 0), its second step
    # tokens one version old
    assert [set(step["lag_histogram"]) for step in steps] == [{"0"}, {"1"}] * 2, steps
