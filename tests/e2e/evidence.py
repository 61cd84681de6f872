"""What a finished run proves about its samples, read from the journal, the trainer's final
checkpoint and its metrics: every attempt is final, and every trained one is in the final weights
exactly once."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Collection
from pathlib import Path

from pipelinerl.coordinator.journal import FORK
from pipelinerl.trainer.checkpoint import CheckpointDir, read_trainer_state


def journal_rows(run_dir: Path) -> dict[str, tuple[str, str | None, int | None]]:
    """sample id -> (state, disposition, version)."""
    journal = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        rows = journal.execute("SELECT sample_id, state, disposition, version FROM attempts").fetchall()
    finally:
        journal.close()
    return {sample_id: (state, disposition, version) for sample_id, state, disposition, version in rows}


def forks(run_dir: Path) -> dict[str, str]:
    """The samples episodes' forks added -> their episode's id: a `~` after the attempt's id, past
    its group's id (which a run id may give a `~` of its own), as `Journal.forked` tells them."""
    journal = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        rows = journal.execute("SELECT sample_id, group_id FROM attempts").fetchall()
    finally:
        journal.close()
    return {
        sample_id: group_id + sample_id[len(group_id) :].partition(FORK)[0]
        for sample_id, group_id in rows
        if FORK in sample_id[len(group_id) :]
    }


def assert_trained_exactly_once(
    run_dir: Path, budget: int, lost: Collection[int] | None = None
) -> Counter[str]:
    """Checks the run in `run_dir` and returns its attempts per final disposition. `lost`: the
    versions trainer crashes lost (published after the last checkpoint, never part of the final
    weights' history); unset, those the final checkpoint records (`lost_versions`).

    Versions never repeat, so each trained id's version names the one step that trained it. Each
    step of the final weights' history must consist of exactly the ids journaled at its version:
    no sample is in two of them, and none is missing."""
    rows = journal_rows(run_dir)
    # An episode whose token stream forked added samples of its own, `<id>~<n>`: the budget counts
    # episodes, and each added sample shares its episode's fate.
    added = forks(run_dir)
    episodes = {i: row for i, row in rows.items() if i not in added}
    assert len(episodes) == budget, f"{len(episodes)} attempts for a budget of {budget}"
    for fork, episode_id in added.items():
        episode = episodes.get(episode_id)
        assert episode is not None and episode[1] == rows[fork][1], f"{fork} ended apart from its episode"
    unfinished = {i: row for i, row in rows.items() if row[0] != "acked"}
    assert not unfinished, f"attempts not final: {sorted(unfinished.items())[:5]}"
    dispositions = Counter(str(d) for _, d, _ in episodes.values())
    reasons = {d for d in dispositions if d != "trained"}
    assert all(d == "dropped" or d.startswith(("failed:", "unscored:")) for d in reasons), dispositions
    trained = {i: v for i, (_, d, v) in rows.items() if d == "trained"}

    checkpoint = CheckpointDir(run_dir / "checkpoints").latest()
    assert checkpoint is not None, "the trainer left no checkpoint"
    state = read_trainer_state(checkpoint).extra_state
    assert state["trained"] == trained, "the checkpoint's trained ids differ from the journal's"
    if lost is None:
        lost = {v for start, end in state.get("lost_versions", []) for v in range(start, end)}

    steps = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    history = {s["version"]: s["samples"] for s in steps if s["stepped"] and s["version"] not in lost}
    per_step = Counter(trained.values())
    assert not set(per_step) - set(history), f"ids trained in lost steps: {set(per_step) - set(history)}"
    assert per_step == Counter(history), "a step of the final weights holds ids journaled elsewhere"
    return dispositions
