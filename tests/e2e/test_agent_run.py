"""An agent run through real processes: `pipelinerl run --agent path.py:function` hosts an agent
that runs its own `openai`-SDK loop (the built-in guess_number agent), whose first play of every
episode crashes after one model call. Each episode is played again with its seed, the crashed
play's recorded call is never trained, and every sample is trained exactly once."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import launch
from tests.data.flaky_agent import CRASHED_PROMPT
from tests.e2e.test_failover import assert_nothing_failed

pytestmark = pytest.mark.slow

BUDGET = 64
AGENT = Path(__file__).resolve().parents[1] / "data" / "flaky_agent.py"


async def test_an_agent_run_trains_each_episode_once_across_agent_crashes(tmp_path: Path) -> None:
    settings = RunSettings(
        run_dir=tmp_path / "run",
        agent=f"{AGENT}:flaky_guess_number",
        environment_args={"high": 8, "turns": 4},
        max_samples=BUDGET,
        duration_s=300,  # a cap: the budget ends the run first
        group_size=4,
        samples_per_step=32,
        max_in_flight=64,
        max_new_tokens=8,
        eval=[],
    )
    last: list[RunInfo] = []
    result = await launch(settings, lambda run, _: last.append(run))
    assert result.state == "completed", result
    assert_nothing_failed(settings.run_dir, settings.run_id, BUDGET)
    episodes = last[-1].progress.episodes
    assert episodes is not None and episodes.episodes >= BUDGET, episodes
    assert episodes.environment_errors >= BUDGET, episodes  # every first play crashed
    assert episodes.forks == 0 and episodes.turns_mean >= 1, episodes
    journal = sqlite3.connect(settings.run_dir / "journal.sqlite")
    rows = journal.execute("SELECT prompt_token_ids, completion FROM attempts WHERE disposition = 'trained'")
    trained = [(json.loads(p), json.loads(c)) for p, c in rows.fetchall()]
    journal.close()
    tokenizer = build_tokenizer()
    several = 0
    for prompt, completion in trained:
        text = str(tokenizer.decode(prompt))
        assert text.endswith("U:guess 1 to 8\nA:") and CRASHED_PROMPT not in text, text
        segments = completion["segments"]
        model = sum(n for kind, n in segments if kind == "model")
        assert model == len(completion["logprobs"]) == len(completion["versions"]) > 0
        several += len(segments) > 1  # the game's replies as context between the model's turns
    assert several > 0, "no episode of several calls"
