"""Agent runs through real processes: `pipelinerl run --agent path.py:function` hosts an agent
that runs its own `openai`-SDK loop (the built-in guess_number agent), whose first play of every
episode crashes after one model call. Each episode is played again with its seed, the crashed
play's recorded call is never trained, and every sample is trained exactly once. And an agent
written in TypeScript with the `openai` npm package, hosted apart, is trained the same way."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import sqlite3
from pathlib import Path

import pytest

from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import launch
from tests.data.flaky_agent import CRASHED_PROMPT
from tests.e2e.evidence import forks
from tests.e2e.test_environment_run import start_typescript_server
from tests.e2e.test_failover import assert_nothing_failed

pytestmark = pytest.mark.slow

BUDGET = 64
AGENT = Path(__file__).resolve().parents[1] / "data" / "flaky_agent.py"


def _settings(run_dir: Path, agent: str, **overrides: object) -> RunSettings:
    fields: dict[str, object] = dict(
        run_dir=run_dir,
        agent=agent,
        environment_args={"high": 8, "turns": 4},
        max_samples=BUDGET,
        duration_s=300,  # a cap: the budget ends the run first
        group_size=4,
        samples_per_step=32,
        max_in_flight=64,
        # The tiny preset's random weights end 4.5 % of their first turns within 8 tokens and 18 %
        # within 32: with 8, one run in 20 had no episode of several calls among its 64.
        max_new_tokens=32,
        eval=[],
    )
    return RunSettings(**(fields | overrides))  # type: ignore[arg-type]


def _trained(run_dir: Path) -> list[tuple[str, dict]]:
    """(decoded prompt, stored completion) of every trained sample an episode began with, its
    segments checked. A fork's sample (the episode went on from a full render of its history, which
    a call after a turn cut by the token limit needs) begins with that history instead."""
    journal = sqlite3.connect(run_dir / "journal.sqlite")
    rows = journal.execute(
        "SELECT sample_id, prompt_token_ids, completion FROM attempts WHERE disposition = 'trained'"
    )
    added = forks(run_dir)
    trained = [(json.loads(p), json.loads(c)) for i, p, c in rows.fetchall() if i not in added]
    journal.close()
    tokenizer = build_tokenizer()
    out = []
    for prompt, completion in trained:
        segments = completion["segments"]
        model = sum(n for kind, n in segments if kind == "model")
        assert model == len(completion["logprobs"]) == len(completion["versions"]) > 0
        out.append((str(tokenizer.decode(prompt)), completion))
    assert any(len(c["segments"]) > 1 for _, c in out), "no episode of several calls"
    return out


async def test_an_agent_run_trains_each_episode_once_across_agent_crashes(tmp_path: Path) -> None:
    settings = _settings(tmp_path / "run", f"{AGENT}:flaky_guess_number")
    last: list[RunInfo] = []
    result = await launch(settings, lambda run, _: last.append(run))
    assert result.state == "completed", result
    assert_nothing_failed(settings.run_dir, settings.run_id, BUDGET)
    episodes = last[-1].progress.episodes
    assert episodes is not None and episodes.episodes >= BUDGET, episodes
    assert episodes.environment_errors >= BUDGET, episodes  # every first play crashed
    assert episodes.forks == 0 and episodes.turns_mean >= 1, episodes
    for prompt, _ in _trained(settings.run_dir):  # the game's replies as context between calls
        assert prompt.endswith("U:guess 1 to 8\nA:") and CRASHED_PROMPT not in prompt, prompt


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node for the TypeScript agent")
async def test_a_run_trains_an_agent_written_in_typescript(tmp_path: Path) -> None:
    ready = tmp_path / "agent.address"
    host = start_typescript_server(ready, "--agent", "--high", "8", "--turns", "4")
    try:
        for _ in range(600):  # compiling takes a while on a busy machine
            if ready.is_file() and ready.read_text().strip():
                break
            assert host.poll() is None, "the TypeScript agent host exited"
            await asyncio.sleep(0.1)
        coordinator = CoordinatorSettings.model_construct(environment_addresses=[ready.read_text().strip()])
        settings = _settings(tmp_path / "run", "guess_number", environment_servers=0, coordinator=coordinator)
        result = await launch(settings)
    finally:
        host.send_signal(signal.SIGTERM)  # by handle: it drains and exits
        host.wait(timeout=30)
    assert result.state == "completed", result
    assert_nothing_failed(settings.run_dir, settings.run_id, BUDGET)
    assert all(prompt.endswith("U:guess 1 to 8\nA:") for prompt, _ in _trained(settings.run_dir))
