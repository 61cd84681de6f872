"""The journal: attempt states survive a reopen, and a resumed run sees exactly what is unfinished."""

from __future__ import annotations

from pathlib import Path

from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.coordinator.journal import AttemptRecord, GroupRecord, Journal


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
        journal.mark_generated(f"r-p0-a{i}", [1, 2], tokens, "56", FinishReason.STOP, "127.0.0.1:1")
    journal.mark_scored([(f"r-p0-a{i}", 0.5, False) for i in range(3)])
    for i in range(3):
        journal.mark_acked(f"r-p0-a{i}", "trained", 5)
    journal.mark_generated("r-p1-a0", [1, 3], tokens, "56", FinishReason.LENGTH, "127.0.0.1:1")
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
