"""Environment runs through real processes: `pipelinerl run --environment` trains on multi-turn
episodes, every sample a token stream of model and context segments that the trainer trains
exactly once, across a coordinator crash too; and an environment written in TypeScript, served
apart, is trained against the same way."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pipelinerl.common.model import export_preset
from pipelinerl.common.presets import CHAT_TEMPLATE
from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.report import read_points
from pipelinerl.launcher.run import launch
from tests.e2e.evidence import assert_trained_exactly_once, forks, journal_rows
from tests.e2e.test_failover import assert_nothing_failed

pytestmark = pytest.mark.slow

BUDGET = 256
TS_SERVER = Path(__file__).resolve().parents[2] / "clients/typescript/examples/guess-number-env/serve.sh"


def _settings(run_dir: Path, **overrides: object) -> RunSettings:
    fields: dict[str, object] = dict(
        run_dir=run_dir,
        environment="guess_number",
        max_samples=BUDGET,
        duration_s=600,  # a cap: the budget ends the run first, within a minute or two
        group_size=4,
        samples_per_step=32,
        max_in_flight=64,
        # The tiny preset's random weights end 4.5 % of their first turns within 8 tokens: a dozen
        # of the 256 episodes have several turns, and short turns keep the runs quick.
        max_new_tokens=8,
    )
    return RunSettings(**(fields | overrides))  # type: ignore[arg-type]


def _episodes(run_dir: Path) -> list[tuple[list[int], dict[str, list]]]:
    """(prompt ids, stored completion) of every trained attempt."""
    journal = sqlite3.connect(run_dir / "journal.sqlite")
    rows = journal.execute(
        "SELECT prompt_token_ids, completion FROM attempts WHERE disposition = 'trained'"
    ).fetchall()
    journal.close()
    return [(json.loads(p), json.loads(c)) for p, c in rows]


def assert_segments_hold(run_dir: Path) -> None:
    """Each trained episode's completion is tiled by its segments, logprobs and versions belong to
    the model's tokens only, and episodes of several turns hold the environment's replies as
    context between the model's turns."""
    tokenizer = build_tokenizer()
    several = 0
    for prompt, completion in _episodes(run_dir):
        segments = completion["segments"]
        assert sum(n for _, n in segments) == len(completion["token_ids"])
        model = sum(n for kind, n in segments if kind == "model")
        assert model == len(completion["logprobs"]) == len(completion["versions"]) > 0
        assert segments[0][0] == "model"  # the prompt ends with the opener: the first turn follows
        assert str(tokenizer.decode(prompt)).endswith("U:guess 1 to 16\nA:")
        if len(segments) > 1:
            several += 1
            text = str(tokenizer.decode(completion["token_ids"]))
            # the environment's reply, then the next opener, between two model turns
            assert any(f"\nU:{reply}\nA:" in text for reply in ("higher", "lower", "a number")), text
    assert several > 0, "no episode of several turns"


async def test_a_run_trains_on_guess_number_episodes(tmp_path: Path) -> None:
    """... and evaluates held-out episodes (seeds training never draws), every turn of each
    evaluation at one weight version, none of them trained."""
    settings = _settings(tmp_path / "run", eval=["environment"], eval_every=4, eval_limit=4)
    last: list[RunInfo] = []
    result = await launch(settings, lambda run, _: last.append(run))
    assert result.state == "completed", result
    assert_nothing_failed(settings.run_dir, settings.run_id, BUDGET)
    assert_segments_hold(settings.run_dir)
    episodes = last[-1].progress.episodes
    assert episodes is not None and episodes.episodes >= BUDGET, episodes
    assert episodes.turns_mean >= 1 and episodes.environment_errors == 0 and episodes.forks == 0, episodes
    points = read_points(settings.run_dir / "metrics.jsonl")
    assert points[-1].episodes is not None and points[-1].episodes["episodes"] == episodes.episodes
    versions = [e.weight_version for e in result.evaluations]
    assert versions and versions == sorted(set(versions)) and versions[0] < 4, versions
    assert versions[-1] == last[-1].progress.trainer_version, (versions, last[-1].progress)
    assert all(e.dataset == "environment:guess_number" and e.problems == 4 for e in result.evaluations)


@pytest.mark.parametrize("victim", ["coordinator", "trainer"])
async def test_episodes_outlive_a_crash_and_are_trained_once(tmp_path: Path, victim: str) -> None:
    """A coordinator SIGKILLed mid-run loses its episodes in flight: the restarted one plays them
    again from their seeds. A trainer SIGKILLed mid-run loses the steps its checkpoint did not
    hold: the journal resends those episodes, segments and all."""
    settings = _settings(tmp_path / "run")
    processes: list[ServiceProcess] = []
    killed: list[int] = []

    def kill_midway(run: RunInfo, elapsed_s: float) -> None:
        if not killed and run.progress.trained >= BUDGET // 4:
            process = next(p for p in processes if p.name == victim)
            process.process.send_signal(signal.SIGKILL)  # by handle; the launcher restarts it
            killed.append(run.progress.trained)

    result = await launch(settings, kill_midway, processes)
    assert killed, f"the run ended before the {victim} could be killed"
    assert result.state == "completed", result
    assert result.restarts.get(victim) == 1, result.restarts
    assert_nothing_failed(settings.run_dir, settings.run_id, BUDGET)
    assert_segments_hold(settings.run_dir)


def start_typescript_server(ready: Path, *flags: str) -> subprocess.Popen[bytes]:
    """The TypeScript example server (`serve.sh`, its package's pinned dependencies installed first
    on a clean clone) on a free port, writing its address to `ready`."""
    package = TS_SERVER.parents[2]
    if not (package / "node_modules").is_dir():
        subprocess.run(["npm", "ci", "--silent", "--no-audit", "--no-fund"], cwd=package, check=True)
    return subprocess.Popen([str(TS_SERVER), *flags, "--port", "0", "--ready-file", str(ready)])


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node for the TypeScript environment")
async def test_a_run_trains_against_an_environment_written_in_typescript(tmp_path: Path) -> None:
    ready = tmp_path / "environment.address"
    server = start_typescript_server(ready)
    try:
        for _ in range(600):  # compiling takes a while on a busy machine
            if ready.is_file() and ready.read_text().strip():
                break
            assert server.poll() is None, "the TypeScript environment exited"
            await asyncio.sleep(0.1)
        address = ready.read_text().strip()
        coordinator = CoordinatorSettings.model_construct(environment_addresses=[address])
        settings = _settings(tmp_path / "run", environment_servers=0, coordinator=coordinator)
        result = await launch(settings)
    finally:
        server.send_signal(signal.SIGTERM)  # by handle: it drains and exits
        server.wait(timeout=30)
    assert result.state == "completed", result
    assert_nothing_failed(settings.run_dir, settings.run_id, BUDGET)
    assert_segments_hold(settings.run_dir)


async def test_an_episode_that_forks_trains_each_of_its_samples_once(tmp_path: Path) -> None:
    """A chat template that writes an earlier assistant turn otherwise than it was sampled (here in
    capitals) cannot be appended to: at each reply after a turn with a lowercase letter the episode
    forks, a new sample starts from the full render, and every sample of the episode is trained
    once with the episode's reward."""
    model = export_preset(tmp_path / "model", "tiny")
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "'A:' + (message.content or '')", "'A:' + (message.content or '') | upper"
    )
    tokenizer.save_pretrained(model)
    settings = _settings(tmp_path / "run", model=str(model))
    last: list[RunInfo] = []
    result = await launch(settings, lambda run, _: last.append(run))
    assert result.state == "completed", result
    rows, added = journal_rows(settings.run_dir), forks(settings.run_dir)
    assert len(rows) - len(added) == BUDGET and added, f"{len(added)} fork samples"
    episodes = last[-1].progress.episodes
    assert episodes is not None and episodes.forks >= len(added), episodes
    assert_trained_exactly_once(settings.run_dir, BUDGET)
    journal = sqlite3.connect(settings.run_dir / "journal.sqlite")
    rewards = dict(journal.execute("SELECT sample_id, reward FROM attempts").fetchall())
    journal.close()
    for fork, episode in added.items():  # each sample of an episode carries the episode's reward
        assert rewards[fork] == rewards[episode]
