"""`pipelinerl run`: every service as its own process on 127.0.0.1, one RL run through the
coordinator, then everything stopped by its handle.

    reward ×R ─┐
    trainer ───┴─ healthy? ─► coordinator ─► inference ×N (register, follow the trainer) ─► StartRun
                                                                          WatchRun ─► metrics.jsonl
    stop: coordinator, inference, trainer, reward (SIGTERM, drain)  ◄── budget, target or Ctrl-C
                                                                         plot.png, summary

On a CPU box, pipeline mode pins inference and the trainer to different cores with one thread
each, so generation and training truly run at once; sync mode gives every phase all the cores,
since its phases never overlap. That makes the two modes a fair comparison on the same machine.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import SamplingParams
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.tasks import max_new_tokens
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec, Mode, RunInfo, RunSpec, RunState
from pipelinerl.launcher.checks import check_run
from pipelinerl.launcher.config import RunSettings, overrides
from pipelinerl.launcher.processes import ServiceProcess, start_service, stop_all, write_targets
from pipelinerl.launcher.report import MetricsLog, Point, plot
from pipelinerl.launcher.supervisor import Supervisor
from pipelinerl.trainer.tracking import StepLogs

log = get_logger(__name__)

HEALTH_TIMEOUT_S = 180.0
EVAL_NICE = 10
"""How much lower the evaluation servers' scheduling priority is on CPU: they then run mostly on the
CPU time the training services leave idle (a nice-10 thread gets about a tenth of a core that a
nice-0 thread also wants)."""
RESUME_EVERY_S = 0.5

Route = Callable[[str, Callable[[], str | None]], str]
"""`route(name, real)`: the address the other services are given for the service `name` (a proxy in
front of it, say); `real()` is the service's own address, None until it serves."""


class RunRefused(InvalidArgument):
    """The coordinator refused to start the run (its spec names the wrong field): it never ran."""


@dataclass(frozen=True)
class RunResult:
    mode: str
    elapsed_s: float
    trained: int
    samples_per_s: float
    final_reward: float
    final_correct: float
    mean_lag: float
    time_to_target_s: float | None
    state: str
    metrics_path: Path
    plot_path: Path
    restarts: dict[str, int]
    """Restarts of each service the supervisor restarted."""
    evaluations: tuple[EvaluationResult, ...] = ()
    """The run's held-out evaluations, oldest first."""


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: the user's section overrides what the launcher sets."""
    merged = dict(base)
    for key, value in override.items():
        merged[key] = (
            merge(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged


def _placement(settings: RunSettings) -> tuple[int, list[set[int] | None], set[int] | None]:
    """(threads per process, cores of each inference server, cores of the trainer)."""
    cores = sorted(os.sched_getaffinity(0))
    n = settings.inference_servers
    if settings.mode == "sync" or not settings.pin_cores or len(cores) < 2:
        return (len(cores) if settings.mode == "sync" else max(len(cores) // (n + 1), 1)), [None] * n, None
    trainer = {cores[-1]}
    inference: list[set[int] | None] = [{cores[i % (len(cores) - 1)]} for i in range(n)]
    return 1, inference, trainer


def _service_settings(settings: RunSettings, run_dir: Path, threads: int) -> dict[str, dict[str, Any]]:
    trainer = {
        "run_id": settings.run_id, "model": settings.model, "seed": settings.seed, "threads": threads,
        "device": settings.device,
        "samples_per_step": settings.samples_per_step, "checkpoint_dir": str(run_dir / "checkpoints"),
        "metrics_file": str(run_dir / "trainer_metrics.jsonl"), "tracking": {"dir": str(run_dir)},
        "learner": {"lr": settings.lr, "temperature": max(settings.temperature, 1e-6),
                    "loss": {"entropy_coef": settings.entropy_coef},
                    "advantages": {"skip_zero_variance": False}},
    }  # fmt: skip
    if settings.entropy_floor is not None:  # unset, the trainer's own default (none) stands
        trainer["learner"]["loss"]["entropy_floor"] = settings.entropy_floor
    if settings.trainer_ranks > 1:
        trainer["backend"] = "deepspeed"
    inference = {
        "model": settings.model,
        "seed": settings.seed,
        "threads": threads,
        "engine": settings.engine,
        "device": settings.device,
        # Each server's window holds its share of the attempts in flight, so a sync round runs as one
        # batch and the pipeline reaches its `max_in_flight`; on CPU a forward's fixed cost dominates
        # a small batch (copy task, 64 → 256 rows: inference 0.386 → 0.307 ms of CPU per sample).
        "max_running": math.ceil(_in_flight(settings) / settings.inference_servers),
    }
    # Every service's: its log level, metrics on a free port (0), and what it requires of its callers.
    shared: dict[str, Any] = {"log_level": settings.log_level}
    if settings.metrics:
        shared["metrics_port"] = 0
    if settings.auth_token is not None:
        shared["auth_token"] = settings.auth_token
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        shared |= {"tls_cert_file": str(settings.tls_cert_file), "tls_key_file": str(settings.tls_key_file)}
    coordinator: dict[str, Any] = {"journal_path": str(run_dir / "journal.sqlite")}
    if settings.auth_token is not None:  # each service calls the others with the same token
        inference["trainer_auth_token"] = inference["coordinator_auth_token"] = settings.auth_token
        coordinator["services_auth_token"] = settings.auth_token
    if settings.client_ca_file is not None:  # each verifies the others' TLS with the run's CA
        inference["trainer_tls_ca_file"] = inference["coordinator_tls_ca_file"] = str(settings.client_ca_file)
        coordinator["services_tls_ca_file"] = str(settings.client_ca_file)
    if settings.episodic:  # the coordinator renders episodes with the model's template
        coordinator["tokenizer"] = settings.model
    if settings.agent is not None:  # the chat-completions endpoint the agents call, on a free port
        coordinator["agent_gateway_port"] = 0
    hosted = {"agent": settings.agent_function} if settings.agent else {"env": settings.environment_class}
    environment = {**hosted, "env_args": settings.environment_args, **shared}
    return {
        "environment": environment,
        "reward": merge({"workers": 1, **shared}, overrides(settings.reward)),
        "trainer": merge({**trainer, **shared}, overrides(settings.trainer)),
        "inference": merge({**inference, **shared}, overrides(settings.inference)),
        "coordinator": merge({**coordinator, **shared}, overrides(settings.coordinator)),
    }


async def launch(
    settings: RunSettings,
    on_progress: Callable[[RunInfo, float], None] | None = None,
    processes: list[ServiceProcess] | None = None,
    on_restart: Callable[[str, int], None] | None = None,
    route: Route | None = None,
) -> RunResult:
    """Run to the end. `processes`, if given, receives the handles of the services as they start
    (a restarted service's new handle replaces its old one). `on_restart(service, restarts)` is told
    of each restart; `route` is `start_services`'. With `settings.coordinator_address`, drive a run
    on services that are already up instead. A service that keeps dying fails the run with
    ServiceFailed.

    InvalidArgument (a `RunRefused` when the coordinator refuses the run) names the wrong setting;
    a run that never started leaves no run directory behind, unless the directory was there before."""
    check_run(settings)
    fresh = not settings.run_dir.exists()
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        if settings.coordinator_address is not None:
            return await _drive(settings, settings.coordinator_address, on_progress)
        processes = [] if processes is None else processes
        return await _start_and_drive(settings, on_progress, processes, on_restart, route)
    except RunRefused:
        if fresh:
            shutil.rmtree(settings.run_dir)
        raise


async def _start_and_drive(
    settings: RunSettings,
    on_progress: Callable[[RunInfo, float], None] | None,
    processes: list[ServiceProcess],
    on_restart: Callable[[str, int], None] | None,
    route: Route | None,
) -> RunResult:
    """The services started, supervised while the run goes on, and stopped, whatever happens."""
    try:
        coordinator = await start_services(settings, processes, route)
        policy, ca = settings.restart, settings.client_ca_file
        supervisor = Supervisor(processes, policy, settings.run_dir, HEALTH_TIMEOUT_S, ca, on_restart)
        return await supervisor.supervised(
            _drive(settings, coordinator.address, on_progress, supervisor.restarts)
        )
    finally:
        cpu = await stop_all(processes)
        (settings.run_dir / "cpu_seconds.json").write_text(json.dumps(cpu, indent=2))


async def start_services(
    settings: RunSettings, processes: list[ServiceProcess], route: Route | None = None
) -> ServiceProcess:
    """Start the reward replicas, the trainer, the coordinator and the inference servers in
    `settings.run_dir`, each once the ones it needs are healthy; the inference servers join the
    coordinator's pool by registering (as in a cluster). Returns the coordinator. `processes`
    receives every handle as it starts, the coordinator last, so that it stops first (the caller
    stops them, also when this fails half-way). With `route`, each service is given the others'
    addresses as it returns them; the launcher's own calls and health checks use the real ones."""
    run_dir = settings.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    threads, inference_cores, trainer_cores = _placement(settings)
    configs = _service_settings(settings, run_dir, threads)
    ca = settings.client_ca_file
    n = settings.reward_servers
    # Each handle goes to `processes` the moment its process exists, so that whatever fails next
    # leaves nothing the caller cannot stop.
    rewards: list[ServiceProcess] = []
    for i in range(n):
        name = "reward" if n == 1 else f"reward-{i}"
        rewards.append(start_service(name, "pipelinerl.reward", configs["reward"], run_dir))
        processes.append(rewards[-1])
    trainer = start_service(
        "trainer",
        "pipelinerl.trainer",
        configs["trainer"],
        run_dir,
        trainer_cores,
        ranks=settings.trainer_ranks,
    )
    processes.append(trainer)
    environments: list[ServiceProcess] = []
    for i in range(settings.environment_servers if settings.episodic else 0):
        name = "environment" if settings.environment_servers == 1 else f"environment-{i}"
        environments.append(start_service(name, "pipelinerl.environment", configs["environment"], run_dir))
        processes.append(environments[-1])
    await asyncio.gather(*(p.wait_healthy(HEALTH_TIMEOUT_S, ca) for p in processes))
    addresses = {
        "inference_addresses": [],
        "reward_address": [_given(route, r.name, processes) for r in rewards],
        "trainer_address": _given(route, "trainer", processes),
    }
    if environments:  # else those the coordinator's section names, if any
        addresses["environment_addresses"] = [_given(route, e.name, processes) for e in environments]
    coordinator = start_service(
        "coordinator", "pipelinerl.coordinator", merge(configs["coordinator"], addresses), run_dir
    )
    processes.append(coordinator)
    await coordinator.wait_healthy(HEALTH_TIMEOUT_S, ca)
    coordinator_address = _given(route, "coordinator", processes)
    inference: list[ServiceProcess] = []
    python = str(settings.vllm_python) if settings.engine == "vllm" else sys.executable
    servers = [(f"inference-{i}", "training", cores, 0) for i, cores in enumerate(inference_cores)]
    nice = EVAL_NICE if settings.device == "cpu" else 0
    servers += [(f"evaluation-{i}", "evaluation", None, nice) for i in range(settings.evaluation_servers)]
    for name, role, cores, nice in servers:
        server = {
            "trainer_address": addresses["trainer_address"],
            "receiver_id": name,
            "role": role,
            "coordinator_address": coordinator_address,
            **_advertised(route, name, processes),
        }
        config = merge(configs["inference"], server)
        inference.append(
            start_service(name, "pipelinerl.inference", config, run_dir, cores, python, nice=nice)
        )
        processes.insert(len(processes) - 1, inference[-1])  # before the coordinator, which stops first
    await asyncio.gather(*(p.wait_healthy(HEALTH_TIMEOUT_S, ca) for p in inference))
    write_targets(run_dir / "prometheus_targets.json", processes)
    return coordinator


def _given(route: Route | None, name: str, processes: list[ServiceProcess]) -> str:
    """The address the other services are given for `name`, whose handle is in `processes` (always
    by the time the route asks: it is put there as the service starts)."""

    def real() -> str | None:  # the current handle's: a restarted service binds the same port
        return next((p.address for p in processes if p.name == name and p.port), None)

    if route is None:
        address = real()
        assert address is not None, f"{name} is not serving yet"
        return address
    return route(name, real)


def _advertised(route: Route | None, name: str, processes: list[ServiceProcess]) -> dict[str, str]:
    """The inference server's `advertise_address`, given before it binds its port (the route's
    `real()` answers once it serves); without a route, none: it advertises the port it binds."""
    return {} if route is None else {"advertise_address": _given(route, name, processes)}


def _spec(settings: RunSettings) -> RunSpec:
    sampling = SamplingParams(max_new_tokens=settings.completion_tokens, temperature=settings.temperature)
    return RunSpec(
        dataset="" if settings.episodic else settings.dataset,
        environment=_environment_name(settings),
        max_turns=settings.max_turns,
        group_size=settings.group_size,
        max_samples=settings.max_samples,
        sampling=sampling,
        mode=Mode(settings.mode),
        max_in_flight=_in_flight(settings),
        seed=settings.seed,
        evaluations=tuple(_evaluation(settings, name) for name in settings.eval_sets),
        epochs=settings.epochs,
        eval_split=settings.eval_split,
    )


def _evaluation(settings: RunSettings, name: str) -> EvaluationSpec:
    """The evaluation of set `name` as the flags describe it; a built-in task's completions get the
    tokens its longest answer needs, other sets the run's."""
    if name == "environment":
        name = f"environment:{_environment_name(settings)}"
    tokens = max_new_tokens(name) if name.startswith("builtin:") else settings.completion_tokens
    sampling = SamplingParams(max_new_tokens=tokens, temperature=settings.eval_temperature)
    return EvaluationSpec(name, settings.eval_every, settings.eval_k, sampling, settings.eval_limit)


def _environment_name(settings: RunSettings) -> str:
    """The name the run's environment (or agent host) describes itself with, or "" for none."""
    if settings.agent_function is not None:
        from pipelinerl.environment.loader import agent_name

        return (
            settings.agent_function
            if settings.environment_servers == 0
            else agent_name(settings.agent_function)
        )
    if settings.environment_class is None:
        return ""
    if settings.environment_servers == 0:  # served apart: the name is given
        return settings.environment_class
    from pipelinerl.environment.loader import load_environment

    return load_environment(settings.environment_class, settings.environment_args).display_name()


def _in_flight(settings: RunSettings) -> int:
    """Attempts the coordinator keeps moving: a whole round in sync mode."""
    if settings.mode == "sync":
        return settings.samples_per_step * settings.round_steps
    return settings.max_in_flight


async def _drive(
    settings: RunSettings,
    address: str,
    on_progress: Callable[[RunInfo, float], None] | None,
    restarts: Counter[str] | None = None,
) -> RunResult:
    """Start the run and follow it to its end. A coordinator that goes away (crashed, frozen, or
    being restarted by the supervisor) is asked again until it answers: StartRun of the same run
    resumes it from the journal, and the watch goes on."""
    tracking = settings.trainer.tracking.model_copy(update={"dir": settings.run_dir})
    # the trainer's run holds every step; the evaluations, logged from here, go in a run of their own
    evaluations = StepLogs()
    if settings.eval_sets:
        evaluations = StepLogs.open(tracking, f"{settings.run_id}-eval", {"eval": settings.eval_sets})
    try:
        metrics = MetricsLog(settings.run_dir / "metrics.jsonl", evaluations)
        return await _watch(settings, address, on_progress, restarts, metrics)
    finally:
        evaluations.close()


async def _watch(
    settings: RunSettings,
    address: str,
    on_progress: Callable[[RunInfo, float], None] | None,
    restarts: Counter[str] | None,
    metrics: MetricsLog,
) -> RunResult:
    channel = ChannelConfig(address, auth_token=settings.auth_token, tls_ca_file=settings.client_ca_file)
    restarts = Counter() if restarts is None else restarts
    async with CoordinatorClient(channel) as client:
        try:
            run = await client.start_run(_spec(settings), run_id=settings.run_id)
        except InvalidArgument as exc:
            raise RunRefused(exc.message, exc.violations) from exc
        started = time.monotonic()
        while not run.state.final:
            try:
                run = await _follow(settings, client, started, metrics, on_progress, restarts)
            except (Unavailable, DeadlineExceeded) as exc:
                log.warning("coordinator unreachable; resuming the run when it answers", error=str(exc))
                run = await _resume(settings, client)
        elapsed = time.monotonic() - started
        if len(run.evaluations) > len(metrics.evaluations):  # the last version's, as the run ended
            metrics.add(Point.of(run, elapsed, restarts), run)
    last = metrics.points[-1] if metrics.points else Point.of(run, elapsed, restarts)
    task = settings.environment or settings.agent or settings.dataset
    title = f"{task} — {settings.mode} mode, {settings.model}"
    plot_path = plot(metrics.points, settings.run_dir / "plot.png", title, metrics.evaluations)
    target = settings.target_reward if settings.target_reward is not None else 0.8
    return RunResult(
        mode=settings.mode,
        elapsed_s=elapsed,
        trained=run.progress.trained,
        samples_per_s=run.progress.trained / elapsed if elapsed > 0 else 0.0,
        final_reward=last.reward,
        final_correct=last.correct,
        mean_lag=sum(p.lag for p in metrics.points) / max(len(metrics.points), 1),
        time_to_target_s=metrics.time_to_reward(target),
        state=run.state.value,
        metrics_path=metrics.path,
        plot_path=plot_path,
        restarts=dict(restarts),
        evaluations=run.evaluations,
    )


async def _follow(
    settings: RunSettings,
    client: CoordinatorClient,
    started: float,
    metrics: MetricsLog,
    on_progress: Callable[[RunInfo, float], None] | None,
    restarts: Counter[str],
) -> RunInfo:
    """The run's last state on its watch stream, stopping it once its budget or target is reached."""
    async for run in client.watch_run(settings.run_id):
        elapsed = time.monotonic() - started
        metrics.add(Point.of(run, elapsed, restarts), run)
        if on_progress is not None:
            on_progress(run, elapsed)
        over = elapsed >= settings.duration_s
        reached = settings.target_reward is not None and run.progress.reward_mean >= settings.target_reward
        if run.state is RunState.RUNNING and (over or (reached and run.progress.trained > 0)):
            return await client.stop_run(settings.run_id, timeout_s=120)
    # A stream that ends without the run's end (a coordinator going away between two messages).
    return await client.get_run(settings.run_id, timeout_s=30)


async def _resume(settings: RunSettings, client: CoordinatorClient) -> RunInfo:
    """StartRun of the run again until the coordinator answers; its journal resumes the run (or
    reports it ended). Without a supervisor behind it, this waits for as long as the run's budget."""
    deadline = time.monotonic() + settings.duration_s
    while True:
        try:
            return await client.start_run(_spec(settings), run_id=settings.run_id, timeout_s=10)
        except (Unavailable, DeadlineExceeded):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(RESUME_EVERY_S)
