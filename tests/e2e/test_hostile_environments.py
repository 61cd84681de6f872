"""Environments that hang, crash, break the contract or vanish, through real processes: each has
its documented outcome (docs/environments.md, Hostile environments), the run goes on, and every
attempt is final exactly once — trained, dropped, or failed with a reason — none trained twice.

An environment's failure is infrastructure, never a score: the episode is played again from the
start with the same seed on a replica that is up, MAX_TRIES times in all, and only then does its
attempt fail (`failed:FAILED_PRECONDITION`, the environment's last error in the coordinator's log).

The environments are `tests/data/hostile_environments.py:Hostile`, served by the launcher's
environment servers, except the one that answers the wrong turn: the SDK server never does, so the
test serves that one itself (`tests/data/wrong_turn_server.py`) and the run plays on it.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipelinerl.common.server import GrpcServer
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.coordinator.datasets import episode_seeds
from pipelinerl.coordinator.episode import MAX_TRIES
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.environment.config import EnvironmentSettings
from pipelinerl.launcher.config import RestartPolicy, RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch
from tests.data.hostile_environments import Hostile
from tests.data.wrong_turn_server import wrong_turn_server
from tests.e2e.evidence import assert_trained_exactly_once, forks

pytestmark = pytest.mark.slow

HOSTILE = Path(__file__).resolve().parents[1] / "data" / "hostile_environments.py"
GROUP_SIZE = 2
BUDGET = 8
GROUPS = BUDGET // GROUP_SIZE
SEED = 0
FAILED = "failed:FAILED_PRECONDITION"
STEP_TIMEOUT = ("PIPELINERL_ENVIRONMENT_STEP_TIMEOUT_S", "2")
"""The servers' limit on the environment's code (60 s by default), set through the environment."""


@dataclass(frozen=True)
class Case:
    behaviour: str
    errors: int | None
    """Environment errors the coordinator counts; None: at least one."""
    failed: int = 0
    """Attempts that fail: those of the group whose seed misbehaves on every play."""
    servers: int = 1
    restarts: tuple[str, ...] = ()
    """Services the launcher restarts, once each."""
    log: str = ""
    """What the run's logs say of the failure."""
    logs: str = "environment*.log"
    """Which of the run's logs say it: the environment servers', or the coordinator's."""
    env: tuple[tuple[str, str], ...] = ()
    """Settings of the environment servers, as their environment variables."""
    served_apart: bool = False
    """The test serves the environment (wrong_turn_server.py), not the launcher."""
    max_new_tokens: int = 4
    """Tokens of a model turn; a turn they cut never reaches StepEpisode."""
    cut_plays: bool = False
    """A play of the bad seed may end before its first step: a first turn the model does not end
    within the context is cut there (`length`), and its attempt is scored as truncated, not failed."""


CASES = [
    # The server's step_timeout_s ends the first episode of each seed (INTERNAL); it is played again.
    Case("hang", GROUPS, log="ran past step_timeout_s", env=(STEP_TIMEOUT,)),
    # The server SIGKILLs itself: the launcher restarts it, the episodes it held are played again.
    Case("crash", None, restarts=("environment",)),
    # The server refuses the reply (INTERNAL) on every play of one seed: its group fails, counted.
    Case("assistant", GROUP_SIZE * MAX_TRIES, failed=GROUP_SIZE, log="an environment writes"),
    # 10 MB is over the server's max_observation_bytes (1 MiB): INTERNAL, as above.
    Case("huge", GROUP_SIZE * MAX_TRIES, failed=GROUP_SIZE, log="bytes of content; the limit is"),
    # The test SIGKILLs one of two replicas while it holds an episode: the other plays on.
    Case("slow", None, servers=2, restarts=("environment-1",)),
    # Every step of one seed says it answers the next turn: the coordinator refuses the reply
    # (INTERNAL) on every play of that seed, as above. Turns long enough for the model's <eos> to
    # end them, so that a play reaches its first step, unless the context's end cuts its turn.
    Case(
        "wrong_turn",
        GROUP_SIZE * MAX_TRIES,
        failed=GROUP_SIZE,
        log="the environment answered turn 2 when asked turn 1",
        logs="coordinator.log",
        served_apart=True,
        max_new_tokens=1000,
        cut_plays=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.behaviour for c in CASES])
async def test_a_hostile_environment_has_its_documented_outcome(
    case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in case.env:  # the launcher's services inherit the test's environment
        monkeypatch.setenv(name, value)
    markers = tmp_path / "markers"
    markers.mkdir()
    bad_seed = next(episode_seeds(SEED))  # the first group's
    environment_args = {
        "behaviour": case.behaviour,
        "marker_dir": str(markers),
        "bad_seed": bad_seed,
        "delay_s": 3.0,
    }
    apart: GrpcServer | None = None
    coordinator = CoordinatorSettings.model_construct()
    if case.served_apart:
        environment = EnvironmentSettings(env=f"{HOSTILE}:Hostile", env_args=environment_args, port=0)
        apart = wrong_turn_server(environment, bad_seed)
        await apart.start()
        coordinator = CoordinatorSettings.model_construct(environment_addresses=[apart.address])
    settings = RunSettings(
        run_dir=tmp_path / "run",
        environment=Hostile.name if apart else f"{HOSTILE}:Hostile",  # served apart: the name it gives
        environment_args=environment_args,
        environment_servers=0 if apart else case.servers,
        coordinator=coordinator,
        seed=SEED,
        max_samples=BUDGET,
        group_size=GROUP_SIZE,
        samples_per_step=GROUP_SIZE * 2,
        max_in_flight=BUDGET,
        max_new_tokens=case.max_new_tokens,
        duration_s=120,
        metrics=False,
        # Other work shares the cores: a service starved for a while is not the one under test.
        restart=RestartPolicy(unhealthy_after_s=60),
    )
    processes: list[ServiceProcess] = []
    restarts: list[str] = []
    killed: list[int] = []
    last: list[RunInfo] = []

    def on_progress(run: RunInfo, elapsed_s: float) -> None:
        last.append(run)
        if case.servers == 1 or killed:
            return
        victim = next(p for p in processes if p.name == "environment-1")
        if (markers / f"started-{victim.process.pid}").exists():  # it holds an episode
            victim.process.kill()  # SIGKILL, by handle
            killed.append(victim.process.pid)

    try:
        result = await launch(settings, on_progress, processes, lambda service, _: restarts.append(service))
    finally:
        if apart is not None:
            await apart.stop(0)

    assert result.state == "completed", result
    if case.servers > 1:
        assert killed, "the run ended before a replica held an episode"
    assert sorted(restarts) == sorted(case.restarts), restarts
    dispositions = assert_trained_exactly_once(settings.run_dir, BUDGET)
    failed = case.failed
    if case.cut_plays:  # the bad group's attempts a cut turn ended never failed: at least one did
        failed -= cut_attempts(settings.run_dir, f"{settings.run_id}-p0")
        assert failed >= 1, dispositions
    assert dispositions[FAILED] == failed, dispositions
    assert set(dispositions) <= {"trained", "dropped", FAILED}, dispositions
    assert dispositions["trained"] >= (BUDGET - case.failed) // 2, dispositions
    episodes = last[-1].progress.episodes
    assert episodes is not None, last[-1]
    points = [json.loads(line) for line in (settings.run_dir / "metrics.jsonl").read_text().splitlines()]
    errors = max(episodes.environment_errors, points[-1]["episodes"]["environment_errors"])
    if case.errors is None:
        assert errors >= 1, episodes
    elif case.cut_plays:  # every play of a failed attempt erred; a cut one may have erred before
        assert MAX_TRIES * failed <= errors <= case.errors, episodes
    else:
        assert errors == case.errors, episodes
    if case.log:
        logs = "".join(p.read_text() for p in settings.run_dir.glob(case.logs))
        assert case.log in logs


def cut_attempts(run_dir: Path, group_id: str) -> int:
    """Attempts of `group_id` (not their forks' samples) whose last play a turn cut by the length
    limit ended (trained, or dropped for lag: not failed)."""
    journal = sqlite3.connect(run_dir / "journal.sqlite")
    try:
        rows = journal.execute(
            "SELECT sample_id FROM attempts WHERE group_id = ? AND finish_reason = 'length'", (group_id,)
        ).fetchall()
    finally:
        journal.close()
    added = forks(run_dir)
    return sum(1 for (sample_id,) in rows if sample_id not in added)
