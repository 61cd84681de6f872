"""`pipelinerl trace`: one attempt's journal record and the log lines of every service that name it
(console or JSON format), in time order; another attempt whose id it prefixes is left out."""

from __future__ import annotations

import json
from pathlib import Path

from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.coordinator.journal import AttemptRecord, GroupRecord, Journal
from pipelinerl.launcher.trace import trace


def write_journal(run_dir: Path) -> None:
    journal = Journal(run_dir / "journal.sqlite")
    journal.create_run("run", {})
    attempts = [AttemptRecord("run-p1-a1", "created"), AttemptRecord("run-p1-a10", "created")]
    journal.add_group("run", GroupRecord("run-p1", 1, "12", "12", "digits", attempts))
    journal.mark_dispatched(["run-p1-a1"])
    tokens = TokenSequence([5, 6, 7], [-0.1, -0.2, -0.3], [3, 3, 4])
    journal.mark_generated(
        [AttemptRecord("run-p1-a1", "generated", [1, 2], tokens, "12", FinishReason.STOP, "127.0.0.1:5001")]
    )
    journal.mark_scored([("run-p1-a1", 0.5, False)])
    journal.mark_acked("run-p1-a1", "trained", 5)
    journal.close()


def test_trace_prints_the_journal_record_then_every_line_naming_the_attempt(tmp_path: Path) -> None:
    write_journal(tmp_path)
    (tmp_path / "coordinator.log").write_text(
        "2026-01-01T00:00:01.000000Z [info] attempt dispatched group_id=run-p1 sample_id=run-p1-a1\n"
        "2026-01-01T00:00:01.500000Z [info] attempt dispatched group_id=run-p1 sample_id=run-p1-a10\n"
        "2026-01-01T00:00:03.000000Z [info] attempt acked disposition=trained sample_id=run-p1-a1\n"
    )
    lines = [
        {"event": "generated", "sample_id": "run-p1-a1", "timestamp": "2026-01-01T00:00:02.000000Z"},
        {"event": "generated", "sample_id": "run-p1-a10", "timestamp": "2026-01-01T00:00:02.100000Z"},
    ]
    (tmp_path / "inference-0.log").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "reward.log").write_text("no attempt here\n")

    printed = trace(tmp_path, "run-p1-a1")

    assert printed[0] == "attempt run-p1-a1 of group run-p1, run run: acked (trained), version 5"
    assert printed[1] == (
        "  server 127.0.0.1:5001, 3 tokens of versions [3, 4], finish stop, reward 0.5, correct no"
    )
    services = [line.split()[0] for line in printed[2:]]
    assert services == ["coordinator", "inference-0", "coordinator"]  # in time order, across files
    assert all("run-p1-a10" not in line for line in printed)


def test_an_unknown_attempt_prints_nothing(tmp_path: Path) -> None:
    write_journal(tmp_path)
    assert trace(tmp_path, "run-p9-a0") == []
