"""A coordinator killed mid-run resumes from its journal: a new coordinator process on the same
journal finishes the run's sample budget, every attempt is acked, none is lost, and the trainer
trains no sample twice (a resend's only effect is a DUPLICATE ack, journaled as trained at the
version the trainer names, or the TRAINED ack of the copy the trainer already held).

The kill lands while the trainer holds samples of the killed coordinator's stream (acked ACCEPTED,
waiting for a full batch), so the resumed run resends samples the trainer has but has not trained:
the trainer keeps one copy and sends its final ack to the new stream.

The run evaluates a held-out set every 4 versions: the evaluations journaled before the kill are
reported after it, none twice, none half counted, and the resumed run evaluates on to its last
version; no evaluation completion reaches the trainer.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from pathlib import Path

import pytest
import yaml

from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.types import RunInfo, RunState
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess, start_service, stop_all
from pipelinerl.launcher.run import HEALTH_TIMEOUT_S, _spec, start_services
from pipelinerl.trainer.client import TrainerClient

pytestmark = pytest.mark.slow

BUDGET = 2048  # 16 trainer steps of 128
KILL_AFTER = 384  # trained samples before the coordinator is killed
RUN_TIMEOUT_S = 45.0
STALL_S = 15.0  # a step takes well under a second here


def evaluations(journal_path: Path) -> list[tuple[str, int, int]]:
    """(dataset, weight version, problems) of each evaluation the journal holds, oldest first."""
    journal = sqlite3.connect(journal_path)
    try:
        rows = journal.execute("SELECT result FROM evaluations ORDER BY rowid").fetchall()
    finally:
        journal.close()
    return [(r["dataset"], r["weight_version"], r["problems"]) for r in (json.loads(row) for (row,) in rows)]


def attempt_states(journal_path: Path) -> dict[str, tuple[str, str | None]]:
    """sample id -> (state, disposition), read from the journal."""
    journal = sqlite3.connect(journal_path)
    try:
        rows = journal.execute("SELECT sample_id, state, disposition FROM attempts").fetchall()
    finally:
        journal.close()
    return {sample_id: (state, disposition) for sample_id, state, disposition in rows}


async def run_to_end(client: CoordinatorClient, trainer: TrainerClient, run_id: str) -> RunInfo:
    """The run once it has ended; fails as soon as the trainer has taken no step for `STALL_S`."""
    version, since = -1, time.monotonic()
    while (run := await client.get_run(run_id)).state is RunState.RUNNING:
        current = (await trainer.status()).version.version
        if current != version:
            version, since = current, time.monotonic()
        assert time.monotonic() - since < STALL_S, f"training stopped at version {version}: {run}"
        await asyncio.sleep(0.1)
    return run


async def test_killed_coordinator_resumes_from_its_journal(tmp_path: Path) -> None:
    # 1.5 steps in flight: while a step trains, at most 64 more samples can reach the trainer, so it
    # holds a partial batch for the kill to land on (with two steps in flight and generation faster
    # than training, it may hold a full batch at every poll).
    settings = RunSettings(
        run_dir=tmp_path / "run", max_samples=BUDGET, max_in_flight=192, eval=["builtin:copy:2"], eval_every=4
    )
    run_dir = settings.run_dir
    processes: list[ServiceProcess] = []
    try:
        first = await start_services(settings, processes)
        trainer = next(p for p in processes if p.name == "trainer")
        # What the launcher gave the coordinator, for the second process, on the port the first one
        # bound: the inference servers registered with that address and keep calling it.
        coordinator_config = yaml.safe_load((run_dir / "coordinator.yaml").read_text())
        coordinator_config["port"] = first.port
        journal_path = Path(coordinator_config["journal_path"])
        async with (
            CoordinatorClient(first.address) as client,
            TrainerClient(trainer.address) as trainer_client,
        ):
            await client.start_run(_spec(settings), run_id=settings.run_id)
            async with asyncio.timeout(RUN_TIMEOUT_S):
                while not (
                    (await client.get_run(settings.run_id)).progress.trained >= KILL_AFTER
                    and 0 < (await trainer_client.status()).buffered_samples < settings.samples_per_step
                ):
                    await asyncio.sleep(0.01)
            first.process.kill()  # SIGKILL, by handle: no drain, nothing flushed
            first.process.wait()
            await asyncio.sleep(1.0)  # a step under way ends; what is left waits for a full batch
            held_at_kill = (await trainer_client.status()).buffered_samples

        evaluated_at_kill = evaluations(journal_path)
        at_kill = attempt_states(journal_path)
        acked_at_kill = {i: d for i, (s, d) in at_kill.items() if s in ("trained", "acked")}
        in_flight_at_kill = {i for i, (s, _) in at_kill.items() if s not in ("trained", "acked")}
        assert len(acked_at_kill) >= KILL_AFTER and in_flight_at_kill, at_kill
        assert len(at_kill) < BUDGET, "the budget was dispatched before the kill"
        # The trainer holds samples it acked ACCEPTED on the dead stream; the resumed run resends them.
        assert 0 < held_at_kill <= len(in_flight_at_kill), held_at_kill

        second = start_service("coordinator", "pipelinerl.coordinator", coordinator_config, run_dir)
        processes.append(second)
        await second.wait_healthy(HEALTH_TIMEOUT_S)
        async with (
            CoordinatorClient(second.address) as client,
            TrainerClient(trainer.address) as trainer_client,
        ):
            await client.start_run(_spec(settings), run_id=settings.run_id)
            async with asyncio.timeout(RUN_TIMEOUT_S):
                run = await run_to_end(client, trainer_client, settings.run_id)
            assert run.state is RunState.COMPLETED, run
            status = await trainer_client.status()
    finally:
        await stop_all(processes)

    # Evaluations: the first version's, then every 4 versions, and the last; those before the kill kept.
    held_out = 11  # the held-out prompts of copy:2
    evaluated = evaluations(journal_path)
    assert evaluated[: len(evaluated_at_kill)] == evaluated_at_kill and evaluated_at_kill, evaluated
    versions = [v for _, v, _ in evaluated]
    assert versions == sorted(set(versions)) and versions[0] < 4, versions
    assert versions[-1] == status.version.version, (versions, status.version)
    assert all(problems == held_out for _, _, problems in evaluated), evaluated
    assert [(e.dataset, e.weight_version) for e in run.evaluations] == [(d, v) for d, v, _ in evaluated]

    final = attempt_states(journal_path)
    assert len(final) == BUDGET  # the budget counts the whole run, not each coordinator process
    assert all(state == "acked" for state, _ in final.values()), final
    assert {d for _, d in final.values()} == {"trained"}

    # The trainer trained every attempt, each exactly once.
    assert status.trained_samples == BUDGET, status
    steps = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    assert sum(step["samples"] for step in steps) == BUDGET, [step["samples"] for step in steps]
