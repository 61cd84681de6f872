"""The coordinator's journal: every attempt's state in SQLite (WAL), so a restart resumes a run
with no attempt lost and none trained twice.

    created ──► dispatched ──► generated ──► scored ──► trained ──► acked (final: trained, dropped, ...)
      (group row holds the prompt, answer and verifier; the run row holds the dataset cursor)

`trained` is an ack of TRAINED whose step no trainer checkpoint holds yet: a trainer crash would
lose it, so it is kept (with its tokens) and resent until the trainer's durable version covers it.
On restart, a group resumes from the earliest state of its attempts: attempts not yet generated
are generated again (their id is kept), generated ones are scored, scored and trained ones are
resubmitted (the trainer acks an id it has already trained on as DUPLICATE).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pipelinerl.common.types import FinishReason, Segment, SegmentKind, TokenSequence
from pipelinerl.coordinator.types import EvaluationResult

FORK = "~"
"""Joins an episode's attempt id and the number of a sample its fork added: `<attempt>~<n>`."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    next_prompt INTEGER NOT NULL DEFAULT 0,
    started_at REAL NOT NULL,
    error TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS groups (
    group_id TEXT PRIMARY KEY,
    run_id TEXT NOT NULL,
    prompt_index INTEGER NOT NULL,
    prompt TEXT NOT NULL,
    answer TEXT NOT NULL,
    verifier TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS attempts (
    sample_id TEXT PRIMARY KEY,
    group_id TEXT NOT NULL REFERENCES groups(group_id),
    state TEXT NOT NULL,
    server TEXT NOT NULL DEFAULT '',
    prompt_token_ids TEXT,
    completion TEXT,
    text TEXT,
    finish_reason TEXT,
    reward REAL,
    correct INTEGER,
    disposition TEXT,
    version INTEGER,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_by_group ON attempts(group_id);
CREATE TABLE IF NOT EXISTS evaluations (
    run_id TEXT NOT NULL,
    dataset TEXT NOT NULL,
    weight_version INTEGER NOT NULL,
    result TEXT NOT NULL,
    PRIMARY KEY (run_id, dataset, weight_version)
);
"""


@dataclass
class AttemptRecord:
    sample_id: str
    state: str
    prompt_token_ids: list[int] | None = None
    completion: TokenSequence | None = None
    text: str = ""
    finish_reason: FinishReason | None = None
    server: str = ""
    """The inference server that generated it."""
    reward: float | None = None
    correct: bool = False
    version: int = -1
    """For `trained`: the version the trainer's step produced."""
    segments: tuple[Segment, ...] = ()
    """An episode's runs of model and context tokens in `completion` (empty: single-turn)."""


@dataclass
class GroupRecord:
    group_id: str
    prompt_index: int
    prompt: str
    answer: str
    verifier: str
    attempts: list[AttemptRecord]


@dataclass
class RunRecord:
    run_id: str
    spec: dict[str, object]
    state: str
    next_prompt: int
    started_at: float
    error: str


_MARK_ACKED = (
    "UPDATE attempts SET state = 'acked', disposition = ?, version = ?, updated_at = ? WHERE sample_id = ?"
)
"""A final disposition: parameters (disposition, version, time, sample id)."""


class Journal:
    def __init__(self, path: Path | str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable across process crashes
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # ---- evaluations: one row each, written whole once it is complete ----------------------------

    def add_evaluation(self, run_id: str, result: EvaluationResult) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO evaluations (run_id, dataset, weight_version, result) "
            "VALUES (?, ?, ?, ?)",
            (run_id, result.dataset, result.weight_version, json.dumps(result.to_json())),
        )

    def evaluations(self, run_id: str) -> list[EvaluationResult]:
        """The run's evaluations, oldest first."""
        rows = self._db.execute("SELECT result FROM evaluations WHERE run_id = ? ORDER BY rowid", (run_id,))
        return [EvaluationResult.from_json(json.loads(text)) for (text,) in rows]

    # ---- runs ---------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> RunRecord | None:
        row = self._db.execute(
            "SELECT run_id, spec, state, next_prompt, started_at, error FROM runs WHERE run_id = ?", (run_id,)
        ).fetchone()
        if row is None:
            return None
        return RunRecord(row[0], json.loads(row[1]), row[2], row[3], row[4], row[5])

    def create_run(self, run_id: str, spec: dict[str, object]) -> RunRecord:
        self._db.execute(
            "INSERT INTO runs (run_id, spec, state, started_at) VALUES (?, ?, 'running', ?)",
            (run_id, json.dumps(spec), time.time()),
        )
        record = self.get_run(run_id)
        assert record is not None
        return record

    def set_run_state(self, run_id: str, state: str, error: str = "") -> None:
        self._db.execute("UPDATE runs SET state = ?, error = ? WHERE run_id = ?", (state, error, run_id))

    # ---- groups and attempts ------------------------------------------------------------------

    def add_group(self, run_id: str, group: GroupRecord) -> None:
        """Record a new group and advance the run's dataset cursor past it, atomically."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT INTO groups VALUES (?, ?, ?, ?, ?, ?)",
                (group.group_id, run_id, group.prompt_index, group.prompt, group.answer, group.verifier),
            )
            self._db.executemany(
                "INSERT INTO attempts (sample_id, group_id, state, updated_at) VALUES (?, ?, 'created', ?)",
                [(a.sample_id, group.group_id, now) for a in group.attempts],
            )
            self._db.execute(
                "UPDATE runs SET next_prompt = MAX(next_prompt, ?) WHERE run_id = ?",
                (group.prompt_index + 1, run_id),
            )

    def mark_dispatched(self, sample_ids: Sequence[str]) -> None:
        """The attempts of a group about to be sent to inference, in one transaction."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE attempts SET state = 'dispatched', updated_at = ? WHERE sample_id = ?",
                [(now, sample_id) for sample_id in sample_ids],
            )

    def mark_generated(self, attempts: Sequence[AttemptRecord]) -> None:
        """Attempts whose completion came back (a group's, once all of them have), in one
        transaction."""
        now = time.time()
        rows = [(*_generated_row(a), now, a.sample_id) for a in attempts]
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE attempts SET state = 'generated', prompt_token_ids = ?, completion = ?, text = ?,"
                " finish_reason = ?, server = ?, updated_at = ? WHERE sample_id = ?",
                rows,
            )

    def mark_played(self, group_id: str, attempts: Sequence[AttemptRecord]) -> None:
        """Episodes of a group, played and rewarded by their environment, in one transaction: each
        attempt scored with its completion, and the samples an episode's forks added (attempts
        not yet in the journal) recorded as scored attempts of the same group."""
        now = time.time()
        rows = [(a.sample_id, group_id, *_generated_row(a), a.reward, int(a.correct), now) for a in attempts]
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "INSERT INTO attempts (sample_id, group_id, state, prompt_token_ids, completion, text,"
                " finish_reason, server, reward, correct, updated_at)"
                " VALUES (?, ?, 'scored', ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (sample_id) DO UPDATE SET state = 'scored',"
                " prompt_token_ids = excluded.prompt_token_ids, completion = excluded.completion,"
                " text = excluded.text, finish_reason = excluded.finish_reason, server = excluded.server,"
                " reward = excluded.reward, correct = excluded.correct, updated_at = excluded.updated_at",
                rows,
            )

    def mark_scored(self, scores: Sequence[tuple[str, float, bool]]) -> None:
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE attempts SET state = 'scored', reward = ?, correct = ?, updated_at = ?"
                " WHERE sample_id = ?",
                [(reward, int(correct), now, sample_id) for sample_id, reward, correct in scores],
            )

    def mark_acked(self, sample_id: str, disposition: str, version: int) -> None:
        self._db.execute(_MARK_ACKED, (disposition, version, time.time(), sample_id))

    def mark_acks(self, trained: Sequence[tuple[str, int]], final: Sequence[tuple[str, str, int]]) -> None:
        """The trainer's final acks of one response, in one transaction. `trained` (sample id, version
        of its step): TRAINED or DUPLICATE, not in a trainer checkpoint yet (`mark_durable` makes
        them final); `final` (sample id, disposition, version): as `mark_acked`."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE attempts SET state = 'trained', disposition = 'trained', version = ?, updated_at = ?"
                " WHERE sample_id = ?",
                [(version, now, sample_id) for sample_id, version in trained],
            )
            self._db.executemany(_MARK_ACKED, [(d, v, now, sample_id) for sample_id, d, v in final])

    def mark_durable(self, sample_ids: Sequence[str]) -> None:
        """These trained attempts are in a trainer checkpoint: final."""
        now = time.time()
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany(
                "UPDATE attempts SET state = 'acked', updated_at = ?"
                " WHERE sample_id = ? AND state = 'trained'",
                [(now, sample_id) for sample_id in sample_ids],
            )

    def unfinished_groups(self, run_id: str) -> Iterator[GroupRecord]:
        """Groups with at least one attempt not yet acked, in prompt order."""
        rows = self._db.execute(
            "SELECT g.group_id, g.prompt_index, g.prompt, g.answer, g.verifier FROM groups g"
            " WHERE g.run_id = ? AND EXISTS"
            " (SELECT 1 FROM attempts a WHERE a.group_id = g.group_id AND a.state != 'acked')"
            " ORDER BY g.prompt_index",
            (run_id,),
        ).fetchall()
        for group_id, prompt_index, prompt, answer, verifier in rows:
            yield GroupRecord(group_id, prompt_index, prompt, answer, verifier, self._attempts(group_id))

    def _attempts(self, group_id: str) -> list[AttemptRecord]:
        rows = self._db.execute(
            "SELECT sample_id, state, prompt_token_ids, completion, text, finish_reason, reward, correct,"
            " version FROM attempts WHERE group_id = ? ORDER BY sample_id",
            (group_id,),
        ).fetchall()
        records = []
        for sample_id, state, prompt_ids, completion, text, reason, reward, correct, version in rows:
            stored = json.loads(completion) if completion else {}
            segments = tuple(Segment(SegmentKind(k), n) for k, n in stored.pop("segments", []))
            tokens = TokenSequence(**stored) if stored else None
            records.append(
                AttemptRecord(
                    sample_id=sample_id,
                    state=state,
                    prompt_token_ids=json.loads(prompt_ids) if prompt_ids else None,
                    completion=tokens,
                    text=text or "",
                    finish_reason=FinishReason(reason) if reason else None,
                    reward=reward,
                    correct=bool(correct),
                    version=-1 if version is None else version,
                    segments=segments,
                )
            )
        return records

    def forked(self, run_id: str) -> int:
        """Samples that episodes' forks added: attempts of their own, not of the groups the run's
        budget counts. Told by the `~` after the attempt's id, past the group's id (which a run id
        may give a `~` of its own)."""
        (n,) = self._db.execute(
            "SELECT COUNT(*) FROM attempts a JOIN groups g ON a.group_id = g.group_id"
            " WHERE g.run_id = ? AND instr(substr(a.sample_id, length(a.group_id) + 1), ?) > 0",
            (run_id, FORK),
        ).fetchone()
        return int(n)

    def counts(self, run_id: str) -> dict[str, int]:
        """Attempts per state (and per final disposition, as `acked:<disposition>`)."""
        rows = self._db.execute(
            "SELECT a.state, a.disposition, COUNT(*) FROM attempts a JOIN groups g ON a.group_id = g.group_id"
            " WHERE g.run_id = ? GROUP BY a.state, a.disposition",
            (run_id,),
        ).fetchall()
        counts: dict[str, int] = {}
        for state, disposition, n in rows:
            key = f"acked:{disposition}" if state == "acked" else state
            counts[key] = counts.get(key, 0) + n
        return counts


def _generated_row(a: AttemptRecord) -> tuple[str, str, str, str, str]:
    """(prompt ids, completion, text, finish reason, server) of a generated attempt, as stored."""
    assert a.completion is not None and a.prompt_token_ids is not None and a.finish_reason is not None
    tokens: dict[str, object] = {
        "token_ids": a.completion.token_ids,
        "logprobs": a.completion.logprobs,
        "versions": a.completion.versions,
    }
    if a.segments:
        tokens["segments"] = [[s.kind.value, s.num_tokens] for s in a.segments]
    return json.dumps(a.prompt_token_ids), json.dumps(tokens), a.text, a.finish_reason.value, a.server
