"""`pipelinerl eval` on a trainer's checkpoint of the tiny preset: greedy figures that repeat from
one invocation to the next, equal what HF `generate` and the reward service's verifiers give on
the same problems, and equal the Evaluate RPC of a coordinator serving the same checkpoint; a model
or set that cannot be read is one line and exit status 2, before any process starts."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pipelinerl.common.model import LoadedModel, export_preset, load_model
from pipelinerl.common.presets import not_a_model
from pipelinerl.coordinator.evaluation import problems_outside_a_run
from pipelinerl.coordinator.tasks import Problem
from pipelinerl.inference.stop import detokenize
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.evaluate import evaluation_spec
from pipelinerl.launcher.processes import ServiceProcess, stop_all
from pipelinerl.launcher.run import start_services
from pipelinerl.reward.verifiers import VERIFIERS, final_answer
from pipelinerl.trainer.checkpoint import CheckpointDir, write_trainer_state

PIPELINERL = Path(sys.executable).parent / "pipelinerl"
SET = ["--dataset", "builtin:copy:3", "--limit", "32"]
FIGURES = ("dataset", "weight_version", "problems", "samples_per_problem", "reward_mean", "pass_at_1",
           "pass_at_k", "completion_tokens_mean", "truncated_fraction")  # fmt: skip
"""What an evaluation measured; not when, how fast, or on which port."""


def pipelinerl_eval(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PIPELINERL), "eval", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


def figures(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.splitlines()[-1])
    return {key: line[key] for key in FIGURES}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory whose trainer committed a checkpoint of version 3: the tiny preset's weights
    drawn from seed 7, in the trainer's own layout."""
    run = tmp_path_factory.mktemp("run")
    checkpoints = CheckpointDir(run / "checkpoints")
    staging = checkpoints.stage(3)
    export_preset(staging, "tiny", seed=7)
    write_trainer_state(staging, 3, None)
    checkpoints.commit(staging)
    return run


@pytest.fixture(scope="module")
def checkpoint(run_dir: Path) -> Path:
    latest = CheckpointDir(run_dir / "checkpoints").latest()
    assert latest is not None and latest.name == "v00000003"
    return latest


@pytest.fixture(scope="module")
def first(run_dir: Path) -> dict[str, Any]:
    """The figures of the command given the run directory (it evaluates the newest checkpoint)."""
    result = pipelinerl_eval("--model", str(run_dir), *SET)
    assert "pass@1" in result.stderr, result.stderr  # the table, on stderr
    return figures(result)


@pytest.mark.slow
def test_greedy_evaluation_of_a_checkpoint_repeats_exactly(first: dict[str, Any], checkpoint: Path) -> None:
    again = figures(pipelinerl_eval("--model", str(checkpoint), *SET, "--json-only"))
    assert again == first
    assert first["problems"] == 32 and first["samples_per_problem"] == 1 and first["weight_version"] == 0


def hf_greedy(loaded: LoadedModel, problems: list[Problem], max_new_tokens: int) -> list[list[int]]:
    """Each problem's completion by HF `generate`, greedy, alone, stopping at end-of-sequence."""
    completions = []
    for problem in problems:
        prompt = loaded.tokenizer(problem.prompt)["input_ids"]
        with torch.no_grad():
            out = loaded.model.generate(
                torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                pad_token_id=loaded.tokenizer.pad_token_id,
            )  # fmt: skip
        completions.append(out[0, len(prompt) :].tolist())
    return completions


def reference(checkpoint: Path, problems: list[Problem], max_new_tokens: int) -> dict[str, float]:
    """The figures from HF `generate` and the verifiers called directly."""
    loaded = load_model(checkpoint)
    eos = loaded.model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    rewards, tokens, truncated = [], [], []
    for problem, ids in zip(problems, hf_greedy(loaded, problems, max_new_tokens), strict=True):
        text = detokenize(loaded.tokenizer, ids)
        score, _ = VERIFIERS[problem.verifier]().score(problem.prompt, text, problem.answer)
        rewards.append(score)
        tokens.append(len(ids))
        truncated.append(len(ids) == max_new_tokens and ids[-1] not in eos_ids)
    return {
        "reward_mean": statistics.fmean(rewards),
        "pass_at_1": statistics.fmean(r >= 1.0 for r in rewards),
        "completion_tokens_mean": statistics.fmean(tokens),
        "truncated_fraction": statistics.fmean(truncated),
    }


@pytest.mark.slow
def test_the_figures_are_those_of_hf_generate_and_the_verifier(
    first: dict[str, Any], checkpoint: Path, tmp_path: Path
) -> None:
    spec = evaluation_spec("builtin:copy:3", k=1, temperature=0.0, limit=32, tokens=None)
    problems = problems_outside_a_run(spec, None)
    expected = reference(checkpoint, problems, spec.sampling.max_new_tokens)
    assert {key: first[key] for key in expected} == pytest.approx(expected)

    # A random model scores near nothing on the task; a set whose gold answers are the final
    # answers of HF's own greedy completions (the `exact` verifier's last line) must score 1.0 on
    # every row, which any difference between the engine's last lines and HF's would break.
    loaded = load_model(checkpoint)
    answers = [final_answer(detokenize(loaded.tokenizer, ids)) for ids in hf_greedy(loaded, problems, 8)]
    rows = [
        {"prompt": p.prompt, "answer": a, "verifier": "exact"} for p, a in zip(problems, answers, strict=True)
    ]
    rows = [row for row in rows if row["answer"].strip()]  # an empty gold answer is refused unscored
    assert len(rows) >= 16, answers
    dataset = tmp_path / "own_answers.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    own = figures(pipelinerl_eval("--model", str(checkpoint), "--dataset", str(dataset),
                                  "--max-new-tokens", "8", "--json-only"))  # fmt: skip
    assert own["problems"] == len(rows)
    assert own["pass_at_1"] == own["reward_mean"] == 1.0, own


@pytest.mark.slow
async def test_the_evaluate_rpc_of_a_coordinator_on_the_checkpoint_gives_the_same_figures(
    first: dict[str, Any], checkpoint: Path, tmp_path: Path
) -> None:
    """The coordinator, trainer, reward and inference server of `pipelinerl run`, serving the
    checkpoint (the trainer publishes it as its version 0); no run is started."""
    processes: list[ServiceProcess] = []
    try:
        settings = RunSettings(run_dir=tmp_path / "run", model=str(checkpoint))
        coordinator = await start_services(settings, processes)
        result = pipelinerl_eval("--coordinator-address", coordinator.address, *SET, "--json-only")
    finally:
        await stop_all(processes)
    assert figures(result) == first


def test_a_missing_model_directory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    result = pipelinerl_eval("--model", str(missing), *SET, timeout_s=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"error: model: {not_a_model(missing)}"]
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("dataset", "why"),
    [
        ("builtin:nope", "expected builtin:<copy|reverse|sort|repeat>[:<size>], got 'builtin:nope'"),
        ("nope.jsonl", "no such file: nope.jsonl"),
    ],
)
def test_a_set_that_cannot_be_read_is_one_line_and_exit_2(dataset: str, why: str) -> None:
    started = time.monotonic()
    result = pipelinerl_eval("--model", "tiny", "--dataset", dataset, timeout_s=60)
    assert result.returncode == 2, result.stderr
    assert time.monotonic() - started < 15  # read before any service started (one takes longer)
    assert result.stderr.splitlines() == [f"error: dataset: {why}"]
