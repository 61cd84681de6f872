"""The `pipelinerl` command.

    pipelinerl run [--config FILE] [--<setting> VALUE ...]
    pipelinerl eval --model MODEL --dataset SET [--k K] [--temperature T] [...]
    pipelinerl serve <service> [--config FILE] [--<setting> VALUE ...]
    pipelinerl health HOST:PORT
    pipelinerl trace RUN_DIR ATTEMPT_ID

Each service's settings are its flags (`pipelinerl serve reward --help` lists them, with their
documentation); environment variables `PIPELINERL_<SERVICE>_<SETTING>` and a YAML/TOML file given
with `--config` fill in the rest. Services are imported lazily, so `serve reward` never loads torch.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)

# Services with a real core to serve; each module has `main(argv)`.
SERVICES = {
    "coordinator": "pipelinerl.coordinator.__main__",
    "environment": "pipelinerl.environment.__main__",
    "inference": "pipelinerl.inference.__main__",
    "reward": "pipelinerl.reward.__main__",
    "trainer": "pipelinerl.trainer.__main__",
}


@app.callback()
def main() -> None:
    """Asynchronous RL for language models with in-flight weight updates, as gRPC services."""


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def serve(
    ctx: typer.Context, service: str = typer.Argument(..., help=f"One of: {', '.join(SERVICES)}")
) -> None:
    """Start one service in the foreground until SIGTERM or Ctrl-C (then drain gracefully)."""
    if service not in SERVICES:
        raise typer.BadParameter(f"unknown service {service!r}; choose one of {', '.join(SERVICES)}")
    importlib.import_module(SERVICES[service]).main(list(ctx.args))


@app.command()
def health(
    address: str = typer.Argument(..., help="host:port of any PipelineRL service"),
    service: str = typer.Option("", help="Full service name to check; empty checks the server as a whole"),
    wait: float = typer.Option(0.0, help="Keep trying for this many seconds until it is SERVING"),
    auth_token: str | None = typer.Option(
        None, envvar="PIPELINERL_AUTH_TOKEN", help="Bearer token, if needed"
    ),
    tls_ca_file: str | None = typer.Option(
        None, help="PEM CA bundle to verify a server that speaks TLS with; unset, the check is plaintext"
    ),
) -> None:
    """Ask a server's grpc.health.v1 service; exit 0 when SERVING, 1 otherwise (for scripts and probes)."""
    import asyncio
    from pathlib import Path

    from pipelinerl.common.health import wait_until_serving

    ca = Path(tls_ca_file) if tls_ca_file else None
    serving = asyncio.run(wait_until_serving(address, service, wait, auth_token, ca))
    typer.echo(f"{address} {service or '(server)'}: {'SERVING' if serving else 'NOT SERVING'}")
    raise typer.Exit(0 if serving else 1)


@app.command()
def trace(
    run_dir: str = typer.Argument(..., help="Directory of a run (`pipelinerl run`'s run_dir)"),
    attempt_id: str = typer.Argument(..., help="Id of an attempt (its sample id, e.g. run-p3-a1)"),
) -> None:
    """Follow one attempt through the services: its journal record, then every log line that names
    it (dispatched, generated, scored, trained or dropped), in time order; exit 1 if none does."""
    from pathlib import Path

    from pipelinerl.launcher.trace import trace as trace_attempt

    lines = trace_attempt(Path(run_dir), attempt_id)
    for line in lines:
        typer.echo(line)
    if not lines:
        typer.echo(f"no attempt {attempt_id!r} in the journal or logs of {run_dir}", err=True)
        raise typer.Exit(1)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []},
)
def run(ctx: typer.Context) -> None:
    """One local RL run: every service as a process, driven to its budget, then stopped.

    Settings are flags (`pipelinerl run --help`), `PIPELINERL_RUN_*` variables, or `--config FILE`.
    A wrong setting prints `error: <setting>: <reason>` and exits 2 before anything starts;
    `--debug` shows the traceback instead. A run that fails exits 1, as does one whose service kept
    dying (the error names it and ends with its log). Ctrl-C, SIGTERM or SIGHUP stop every service
    and exit 128 + the signal's number, unless the run had finished.
    """
    import asyncio

    from pipelinerl.common.log import configure_logging
    from pipelinerl.launcher.checks import load_settings, user_error
    from pipelinerl.launcher.display import RunDisplay
    from pipelinerl.launcher.interrupt import Interrupted, until_signalled
    from pipelinerl.launcher.run import launch
    from pipelinerl.launcher.supervisor import ServiceFailed

    args = list(ctx.args)
    debug = "--debug" in args
    try:
        settings = load_settings([arg for arg in args if arg != "--debug"])
        configure_logging("launcher", "console", "warning")
        with RunDisplay(settings) as display:
            running = launch(settings, display.update, on_restart=display.restarted)
            result = asyncio.run(until_signalled(running))
    except Interrupted as exc:
        typer.echo(f"{exc}; every service it started is stopped", err=True)
        raise typer.Exit(exc.exit_code) from None
    except ServiceFailed as exc:
        if debug:
            raise
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:
        lines = None if debug else user_error(exc)
        if lines is None:
            raise
        for line in lines:
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(2) from None
    typer.echo(
        f"{result.state}: final mean reward {result.final_reward:.3f} "
        f"(exactly correct {result.final_correct:.3f}) after {result.elapsed_s:.0f} s, "
        f"{result.trained} samples trained ({result.samples_per_s:.1f}/s)"
    )
    for e in {e.dataset: e for e in result.evaluations}.values():  # the latest of each set
        k = e.samples_per_problem
        typer.echo(
            f"held-out {e.dataset} at version {e.weight_version}: pass@1 {e.pass_at_1:.3f}"
            + (f", pass@{k} {e.pass_at_k:.3f}" if k > 1 else "")
            + f", mean reward {e.reward_mean:.3f} ({e.problems} problems)"
        )
    if result.restarts:
        restarts = ", ".join(f"{name} {n}" for name, n in sorted(result.restarts.items()))
        typer.echo(f"restarts: {restarts} (why: {settings.run_dir}/launcher.log)")
    typer.echo(f"plot: {result.plot_path}\nmetrics: {result.metrics_path}\nlogs: {settings.run_dir}/*.log")
    if result.state == "failed":  # the coordinator's log says why
        raise typer.Exit(1)


@app.command(name="eval")
def evaluate(
    dataset: str = typer.Option(
        ..., help="The set: builtin:<task>[:<size>] (its held-out problems) or a JSONL/parquet file"
    ),
    model: str | None = typer.Option(
        None, help="A preset, an HF model directory, a checkpoint, or a run directory (its newest checkpoint)"
    ),
    k: int = typer.Option(1, "--k", min=1, help="Completions per problem: the k of pass@k"),
    temperature: float = typer.Option(0.0, min=0.0, help="Sampling temperature; 0 is greedy"),
    limit: int = typer.Option(0, min=0, help="The first this many problems; 0: a file's all, 256 of a task"),
    max_new_tokens: int | None = typer.Option(
        None, min=1, help="Tokens per completion; unset: what a built-in task needs, else 512"
    ),
    seed: int = typer.Option(0, help="Seed of a preset's random weights"),
    device: str = typer.Option("cpu", help="Where the model runs: cpu or cuda[:N]"),
    coordinator_address: str | None = typer.Option(
        None, help="host:port of a coordinator to evaluate on (its servers and model) instead"
    ),
    auth_token: str | None = typer.Option(
        None, envvar="PIPELINERL_AUTH_TOKEN", help="The coordinator's bearer token, if it needs one"
    ),
    tls_ca_file: str | None = typer.Option(
        None, help="PEM CA bundle to verify a coordinator that speaks TLS"
    ),
    json_only: bool = typer.Option(False, "--json-only", help="Print the JSON line only, no table"),
) -> None:
    """Evaluate a model or a checkpoint on one set, as a run evaluates it; print a table (stderr)
    and the result as one JSON line (stdout).

    Without --coordinator-address, an inference server with the model and a reward service run as
    processes for it, stopped at the end. A wrong flag (a model or set that cannot be read) prints
    `error: <flag>: <reason>` and exits 2; a service or an evaluation that fails exits 1.
    """
    import asyncio
    import signal
    from pathlib import Path

    from pipelinerl.common.errors import InvalidArgument, PipelineError
    from pipelinerl.common.log import configure_logging
    from pipelinerl.launcher.evaluate import (
        evaluate_model,
        evaluate_remote,
        evaluation_spec,
        flag_of,
        print_table,
        resolve_model,
        result_json,
    )
    from pipelinerl.launcher.interrupt import Interrupted, until_signalled

    configure_logging("launcher", "console", "warning")
    try:
        spec = evaluation_spec(dataset, k=k, temperature=temperature, limit=limit, tokens=max_new_tokens)
        if coordinator_address is not None:
            if model is not None:
                raise InvalidArgument.field("model", "the coordinator's servers hold their own model")
            ca = Path(tls_ca_file) if tls_ca_file else None
            running = evaluate_remote(coordinator_address, spec, auth_token, ca)
            shown = coordinator_address
        elif model is None:
            raise InvalidArgument.field("model", "needed without --coordinator-address")
        else:
            shown = resolve_model(model)
            running = evaluate_model(shown, spec, seed=seed, device=device)
        result = asyncio.run(until_signalled(running))
    except InvalidArgument as exc:
        for v in exc.violations or ():
            typer.echo(f"error: {flag_of(v.field)}: {v.description}", err=True)
        if not exc.violations:
            typer.echo(f"error: {exc.message}", err=True)
        raise typer.Exit(2) from None
    except Interrupted as exc:
        name = signal.Signals(exc.signum).name
        typer.echo(f"stopped by {name}; every service it started is stopped", err=True)
        raise typer.Exit(exc.exit_code) from None
    except (PipelineError, RuntimeError) as exc:  # a service that failed (ServiceFailed is one)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if not json_only:
        print_table(result, shown)
    typer.echo(result_json(result))
