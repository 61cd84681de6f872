"""Series read back from the trainer's experiment tracking with each library's own reader:
TensorBoard's event accumulator, and `wandb leet inspect --json` over an offline run's log."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

Series = dict[str, list[tuple[int, float]]]
"""name -> (step, value) in logging order."""


def tensorboard_series(directory: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_series(wandb_dir: Path) -> Series:
    """The histories of the offline runs under `wandb_dir` (the trainer's, and the evaluations' when
    the run has any: their names differ)."""
    wandb = Path(sys.executable).parent / "wandb"
    series: Series = {}
    for run_log in sorted(wandb_dir.glob("offline-run-*/run-*.wandb")):
        records = subprocess.run(
            [wandb, "leet", "inspect", "--json", str(run_log)],
            capture_output=True, text=True, timeout=120, check=True, stdin=subprocess.DEVNULL,
        ).stdout  # fmt: skip
        _add_history(records, series)
    return series


def _add_history(records: str, series: Series) -> None:
    for line in records.splitlines():
        record = json.loads(line)
        if record.get("type") != "history":
            continue
        item = record["history"]["item"]
        for name, value in item.items():
            if not name.startswith("_"):
                series.setdefault(name, []).append((item["_step"], value))
