"""`pipelinerl eval`: one evaluation of a model or a checkpoint on one set, through the code a run's
evaluations go through (`Evaluator`), with no trainer and nothing journaled.

    --model: preset | HF model dir | checkpoint dir | run dir (its newest checkpoint)
        the set read ─► reward, inference (the model, version 0) as processes ─► healthy
        ─► InferencePool + RewardPool here ─► Evaluator.evaluate_once ─► EvaluationResult
        ─► every process stopped by its handle
    --coordinator-address: Evaluate on that coordinator (its servers, at their newest version)

The set is read before anything starts, so a set that cannot be read costs no process. A service
that dies while it evaluates fails the evaluation at once, with the end of its log.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.presets import PRESETS, not_a_model
from pipelinerl.common.types import SamplingParams
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.convert import evaluation_from_proto, evaluation_to_proto
from pipelinerl.coordinator.evaluation import Evaluator, problems_outside_a_run
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.reward_pool import RewardPool
from pipelinerl.coordinator.tasks import Problem, max_new_tokens
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec
from pipelinerl.launcher.config import RestartPolicy
from pipelinerl.launcher.processes import ServiceProcess, start_service, stop_all
from pipelinerl.launcher.run import HEALTH_TIMEOUT_S
from pipelinerl.launcher.supervisor import Supervisor

DEFAULT_MAX_NEW_TOKENS = 512
"""Tokens per completion of a file's set when `--max-new-tokens` is unset (a built-in task's
completions get what its longest answer needs)."""
EVALUATE_TIMEOUT_S = 3600.0
"""Deadline of an Evaluate call to a coordinator."""


def evaluation_spec(
    dataset: str, *, k: int, temperature: float, limit: int, tokens: int | None
) -> EvaluationSpec:
    """The evaluation the flags describe, checked as the Evaluate RPC checks its request:
    InvalidArgument naming the field (`flag_of` names its flag)."""
    if tokens is None:
        tokens = max_new_tokens(dataset) if dataset.startswith("builtin:") else DEFAULT_MAX_NEW_TOKENS
    sampling = SamplingParams(max_new_tokens=tokens, temperature=temperature)
    spec = EvaluationSpec(
        dataset, every_versions=0, samples_per_problem=k, sampling=sampling, max_problems=limit
    )
    return evaluation_from_proto(evaluation_to_proto(spec))


def resolve_model(model: str) -> str:
    """What the inference server's `model` setting takes for `model`: a preset's name, or an HF
    model directory: `model` itself (a checkpoint is one), the newest checkpoint of a run directory
    or of its `checkpoints` folder. InvalidArgument on `model` otherwise."""
    if model in PRESETS:
        return model
    path = Path(model)
    if not path.is_dir():
        raise InvalidArgument.field("model", not_a_model(model))
    if (path / "config.json").is_file():
        return str(path)
    from pipelinerl.trainer.checkpoint import latest_checkpoint  # loads torch: only for a run's folder

    for folder in (path / "checkpoints", path):
        if (latest := latest_checkpoint(folder)) is not None:
            return str(latest)
    raise InvalidArgument.field("model", f"{model} holds neither an HF model (config.json) nor a checkpoint")


async def evaluate_model(model: str, spec: EvaluationSpec, *, seed: int, device: str) -> EvaluationResult:
    """`spec` evaluated on `model` (`resolve_model`'s), served by an inference server and scored by a
    reward service started for it; InvalidArgument before anything starts when the set cannot be
    read; RuntimeError (ServiceFailed) naming a service that fails, with the end of its log."""
    problems = problems_outside_a_run(spec, None)  # as a run's coordinator, which has no tokenizer
    inference = {"model": model, "seed": seed, "device": device}
    with tempfile.TemporaryDirectory(prefix="pipelinerl-eval-") as folder:
        work = Path(folder)
        processes: list[ServiceProcess] = []
        try:
            reward = start_service("reward", "pipelinerl.reward", {"workers": 1}, work)
            processes.append(reward)
            server = start_service("inference", "pipelinerl.inference", inference, work)
            processes.append(server)
            for process in processes:
                await process.wait_healthy(HEALTH_TIMEOUT_S)
            supervisor = Supervisor(processes, RestartPolicy(max_restarts=0), work, HEALTH_TIMEOUT_S)
            return await supervisor.supervised(_evaluate_on(spec, problems, server.address, reward.address))
        finally:
            await stop_all(processes)


async def _evaluate_on(
    spec: EvaluationSpec, problems: list[Problem], inference: str, reward: str
) -> EvaluationResult:
    pool = InferencePool(ChannelConfig, [inference])
    rewards = RewardPool(ChannelConfig, [reward])
    await pool.start()
    await rewards.start()
    try:
        return await Evaluator(pool, rewards).evaluate_once(spec, problems, "eval", HEALTH_TIMEOUT_S)
    finally:
        await pool.close()
        await rewards.close()


async def evaluate_remote(
    address: str, spec: EvaluationSpec, auth_token: str | None, tls_ca_file: Path | None
) -> EvaluationResult:
    """`spec` evaluated by the coordinator at `address` (Evaluate), on its servers."""
    channel = ChannelConfig(address, auth_token=auth_token, tls_ca_file=tls_ca_file)
    async with CoordinatorClient(channel) as client:
        return await client.evaluate(spec, timeout_s=EVALUATE_TIMEOUT_S)


def result_json(result: EvaluationResult) -> str:
    """The result as one JSON line: every field of it, `finished_at` in ISO 8601."""
    return json.dumps(result.to_json())


_FLAGS = {
    "model": "model",
    "samples_per_problem": "k",
    "temperature": "temperature",
    "max_problems": "limit",
    "max_new_tokens": "max-new-tokens",
}


def flag_of(field: str) -> str:
    """The flag behind a field of a refused evaluation (`evaluation.sampling.max_new_tokens` is
    `max-new-tokens`); what the set itself is refused for names `dataset`."""
    return _FLAGS.get(field.rsplit(".", 1)[-1], "dataset")


def print_table(result: EvaluationResult, model: str) -> None:
    """The result as a table on stderr, so that stdout holds the JSON line alone."""
    table = Table(title=f"{result.dataset} — {model}", show_header=False)
    k = result.samples_per_problem
    rows = [
        ("weight version", str(result.weight_version)),
        ("problems × samples", f"{result.problems} × {k}"),
        ("reward mean", f"{result.reward_mean:.4f}"),
        ("pass@1", f"{result.pass_at_1:.4f}"),
        *([(f"pass@{k}", f"{result.pass_at_k:.4f}")] if k > 1 else []),
        ("completion tokens (mean)", f"{result.completion_tokens_mean:.1f}"),
        ("truncated", f"{result.truncated_fraction:.1%}"),
        ("seconds", f"{result.duration_s:.1f}"),
        ("server", result.server),
    ]
    for row in rows:
        table.add_row(*row)
    Console(stderr=True).print(table)
