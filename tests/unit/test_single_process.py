"""benchmarks/single_process.py runs the method in one process with `pipelinerl run`'s defaults and
ends with its figures as one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.single_process import sample_batch
from pipelinerl.common.model import build_preset
from pipelinerl.launcher.config import RunSettings

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "single_process.py"


@pytest.mark.slow
def test_a_short_run_ends_with_its_figures() -> None:
    args = ["--samples", "256", "--samples-per-step", "64", "--lag", "1", "--threads", "1", "--target", "0.0"]
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout.splitlines()[-1])
    assert figures["samples_per_s"] > 0 and 0 <= figures["reward_last_8192"] <= 1
    assert figures["reward_mean"] == figures["reward_last_8192"]  # 256 samples: the last 8,192 are all
    assert 0 < figures["step_kl"] < 1  # the optimizer moved the policy, by less than a nat per token
    assert figures["samples_to_target"] is None  # 256 samples are less than the 1,024 of its window
    assert 0 <= figures["zero_variance_fraction"] <= 1 and figures["entropy"] > 0
    assert figures["learner"]["loss"]["entropy_coef"] == RunSettings.model_fields["entropy_coef"].default


def test_an_update_in_flight_samples_the_second_half_with_the_newer_weights() -> None:
    older, newer = build_preset("tiny", seed=0), build_preset("tiny", seed=1)
    torch.manual_seed(0)
    rollouts = sample_batch(older.model, older.tokenizer, ["12345", "7"], 2, 6, 1.0, newer.model)

    going = [(prompt, tokens) for prompt, tokens, _ in rollouts if len(tokens) > 3]
    assert going  # a random model seldom ends within 3 tokens
    for prompt, tokens in going:
        assert tokens.versions == [0, 0, 0, 1, 1, 1][: len(tokens)]
        # the fourth token's logprob is the newer weights', given the older ones' first three
        with torch.no_grad():
            logits = newer.model(torch.tensor([prompt + tokens.token_ids[:3]])).logits[0, -1]
            old_logits = older.model(torch.tensor([prompt + tokens.token_ids[:3]])).logits[0, -1]
        fourth = tokens.token_ids[3]
        assert tokens.logprobs[3] == pytest.approx(float(logits.log_softmax(-1)[fourth]), abs=1e-4)
        assert tokens.logprobs[3] != pytest.approx(float(old_logits.log_softmax(-1)[fourth]), abs=1e-4)
