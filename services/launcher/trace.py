"""`pipelinerl trace RUN_DIR ATTEMPT_ID`: one attempt's path through the services, from the
coordinator's journal (`<run_dir>/journal.sqlite`) and every service's log (`<run_dir>/*.log`).

    attempt run-p3-a1 of group run-p3, run run: acked (trained), version 5
      server 127.0.0.1:40123, 3 tokens of versions [3, 4], finish stop, reward 0.5, correct no
    inference-0  2026-12-04T18:27:44.180Z [debug] generated  tokens=3 versions=[3, 4] …
    coordinator  2026-12-04T18:27:44.203Z [debug] attempt generated  server=127.0.0.1:40123 …

Every service logs an attempt's events with its id (`sample_id`), at debug level for an attempt
that goes well, so the log lines are those that name it, whatever their format (console or JSON),
in time order; at info level a run's logs name only the attempts that went wrong.
"""

from __future__ import annotations

import json
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LogLine:
    timestamp: str
    service: str
    text: str


def journal_summary(run_dir: Path, attempt_id: str) -> list[str]:
    """What the journal holds of the attempt, in two lines; none if it holds nothing."""
    path = run_dir / "journal.sqlite"
    if not path.exists():
        return []
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        row = db.execute(
            "SELECT g.run_id, a.group_id, a.state, a.disposition, a.version, a.server, a.completion,"
            " a.finish_reason, a.reward, a.correct FROM attempts a JOIN groups g ON a.group_id = g.group_id"
            " WHERE a.sample_id = ?",
            (attempt_id,),
        ).fetchone()
    finally:
        db.close()
    if row is None:
        return []
    run, group, state, disposition, version, server, completion, finish, reward, correct = row
    outcome = f"{state} ({disposition})" if disposition else state
    head = f"attempt {attempt_id} of group {group}, run {run}: {outcome}"
    if version is not None and version >= 0:
        head += f", version {version}"
    if completion is None:
        return [head, "  not generated yet"]
    versions = json.loads(completion)["versions"]
    detail = f"  server {server}, {len(versions)} tokens of versions {sorted(set(versions))}, finish {finish}"
    if reward is not None:
        detail += f", reward {reward:g}, correct {'yes' if correct else 'no'}"
    return [head, detail]


def log_lines(run_dir: Path, attempt_id: str) -> list[LogLine]:
    """Every line of the run's service logs that names the attempt, in time order."""
    named = re.compile(rf"(?<![\w-]){re.escape(attempt_id)}(?![\w-])")
    found: list[LogLine] = []
    for path in sorted(run_dir.glob("*.log")):
        timestamp = ""
        for line in path.read_text(errors="replace").splitlines():
            timestamp = _timestamp(line) or timestamp  # a line without one follows the last that had one
            if named.search(line):
                found.append(LogLine(timestamp, path.stem, line))
    return sorted(found, key=lambda line: line.timestamp)  # stable: a file's own order is kept


def trace(run_dir: Path, attempt_id: str) -> list[str]:
    """The journal's summary, then the log lines; empty if neither knows the attempt."""
    lines = log_lines(run_dir, attempt_id)
    width = max((len(line.service) for line in lines), default=0)
    return [
        *journal_summary(run_dir, attempt_id),
        *(f"{line.service:<{width}}  {line.text}" for line in lines),
    ]


def _timestamp(line: str) -> str:
    """The ISO timestamp a log line starts with (console format) or holds (JSON format)."""
    if line.startswith("{"):
        try:
            value = json.loads(line).get("timestamp", "")
        except (json.JSONDecodeError, AttributeError):
            return ""
        return value if isinstance(value, str) else ""
    first = line.split(" ", 1)[0]
    return first if re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z?", first) else ""
