"""A run ends when its budget is trained, whatever the trainer's step size: the last, partial step
is trained on a flush and checkpointed (before, a run of 18 samples in steps of 4 stayed RUNNING at
16, and a sync round smaller than a step never trained)."""

from __future__ import annotations

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
