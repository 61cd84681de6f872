"""The `pipelinerl` command.

    pipelinerl run [--config FILE] [--<setting> VALUE ...]
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
    if result.restarts:
        restarts = ", ".join(f"{name} {n}" for name, n in sorted(result.restarts.items()))
        typer.echo(f"restarts: {restarts} (why: {settings.run_dir}/launcher.log)")
    typer.echo(f"plot: {result.plot_path}\nmetrics: {result.metrics_path}\nlogs: {settings.run_dir}/*.log")
    if result.state == "failed":  # the coordinator's log says why
        raise typer.Exit(1)
