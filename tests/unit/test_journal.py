"""The journal: attempt states survive a reopen, a resumed run sees exactly what is unfinished, and
its progress (and so its sample budget) counts what the run did before the restart."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.coordinator.journal import FORK, AttemptRecord, GroupRecord, Journal
from pipelinerl.coordinator.loop import RunLoop
from pipelinerl.coordinator.types import RunSpec


def group(index: int) -> GroupRecord:
    attempts = [AttemptRecord(f"r-p{index}-a{i}", "created") for i in range(3)]
    return GroupRecord(f"r-p{index}", index, f"{index}=", str(index), "digits", attempts)


def test_states_survive_reopen_and_drive_resumption(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    journal.create_run("r", {"dataset": "builtin:copy:2"})
    for index in range(2):
        journal.add_group("r", group(index))
    tokens = TokenSequence([5, 6], [-0.1, -0.2], [3, 4])
    for i in range(3):
        journal.mark_generated(
            [AttemptRecord(f"r-p0-a{i}", "generated", [1, 2], tokens, "56", FinishReason.STOP, "127.0.0.1:1")]
        )
    journal.mark_scored([(f"r-p0-a{i}", 0.5, False) for i in range(3)])
    for i in range(3):
        journal.mark_acked(f"r-p0-a{i}", "trained", 5)
    journal.mark_generated(
        [AttemptRecord("r-p1-a0", "generated", [1, 3], tokens, "56", FinishReason.LENGTH, "127.0.0.1:1")]
    )
    journal.close()

    reopened = Journal(path)
    assert reopened.get_run("r").next_prompt == 2  # type: ignore[union-attr]
    [unfinished] = list(reopened.unfinished_groups("r"))
    assert unfinished.group_id == "r-p1" and unfinished.answer == "1"
    states = {a.sample_id: a.state for a in unfinished.attempts}
    assert states == {"r-p1-a0": "generated", "r-p1-a1": "created", "r-p1-a2": "created"}
    generated = next(a for a in unfinished.attempts if a.state == "generated")
    assert generated.completion == tokens and generated.prompt_token_ids == [1, 3]
    assert generated.finish_reason is FinishReason.LENGTH
    assert reopened.counts("r") == {"acked:trained": 3, "generated": 1, "created": 2}


def test_a_resumed_run_spends_its_budget_on_episodes_not_on_their_forks(tmp_path: Path) -> None:
    """The samples an episode's fork added are played and counted as generated, but the budget
    counts the attempts groups are made with: a resumed run must not stop short by its forks.
    A run id with a `~` of its own is no fork."""
    journal = Journal(tmp_path / "journal.sqlite")
    journal.create_run("r~1", {"env": "builtin:guess_number"})
    attempts = [AttemptRecord(f"r~1-p0-a{i}", "created") for i in range(3)]
    journal.add_group("r~1", GroupRecord("r~1-p0", 0, "7", "", "environment", attempts))
    tokens = TokenSequence([5], [-0.1], [0])
    played = [
        AttemptRecord(sample_id, "generated", [1], tokens, "5", FinishReason.STOP, "127.0.0.1:1", reward=1.0)
        for sample_id in ("r~1-p0-a0", f"r~1-p0-a0{FORK}1", f"r~1-p0-a0{FORK}2", "r~1-p0-a1")
    ]
    journal.mark_played("r~1-p0", played)
    assert journal.forked("r~1") == 2

    stub = SimpleNamespace(snapshot=list, latest_version=0)
    spec = RunSpec("", group_size=3, max_samples=6)
    progress = RunLoop("r~1", spec, journal, stub, stub, stub, iter(())).progress()  # type: ignore[arg-type]
    assert (progress.dispatched, progress.generated, progress.scored) == (3, 4, 4)


def test_a_resumed_run_counts_what_the_journal_holds(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite")
    journal.create_run("r", {"dataset": "builtin:copy:2"})
    for index in range(3):
        journal.add_group("r", group(index))
    tokens = TokenSequence([5], [-0.1], [0])
    generated = ["r-p0-a0", "r-p0-a1", "r-p0-a2", "r-p1-a0", "r-p1-a1"]
    for sample_id in generated:
        journal.mark_generated(
            [AttemptRecord(sample_id, "generated", [1], tokens, "5", FinishReason.STOP, "127.0.0.1:1")]
        )
    journal.mark_scored([(sample_id, 1.0, True) for sample_id in generated[:4]])
    journal.mark_acked("r-p0-a0", "trained", 1)
    journal.mark_acked("r-p0-a1", "dropped", 1)
    journal.mark_acked("r-p0-a2", "duplicate", 1)
    journal.mark_acked("r-p1-a2", "failed:INVALID_ARGUMENT", -1)  # never generated
    journal.mark_acked("r-p1-a1", "unscored:INTERNAL", -1)  # generated, not scored

    stub = SimpleNamespace(snapshot=list, latest_version=1)
    spec = RunSpec("builtin:copy:2", group_size=3, max_samples=9)
    loop = RunLoop("r", spec, journal, stub, stub, stub, iter(()))  # type: ignore[arg-type]

    progress = loop.progress()
    assert (progress.dispatched, progress.generated, progress.scored) == (9, 5, 4)
    assert (progress.trained, progress.dropped) == (1, 1)


def test_a_dispatched_attempt_is_generated_again_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "journal.sqlite"
    journal = Journal(path)
    journal.create_run("r", {"dataset": "builtin:copy:2"})
    journal.add_group("r", group(0))
    journal.mark_dispatched(["r-p0-a0"])
    journal.close()

    reopened = Journal(path)
    [unfinished] = list(reopened.unfinished_groups("r"))
    dispatched = next(a for a in unfinished.attempts if a.sample_id == "r-p0-a0")
    assert dispatched.state == "dispatched" and dispatched.completion is None
    assert reopened.counts("r") == {"dispatched": 1, "created": 2}


def test_the_default_journal_lives_in_the_state_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    path = CoordinatorSettings().journal_path
    assert path == tmp_path / "state" / "pipelinerl" / "coordinator.sqlite"
    Journal(path).close()  # its folder is made on first use
    assert path.exists()
