"""The service processes of a local run: started with their own config file, on ports the launcher
holds for them until they stop for good (`ports.py`: chosen by the kernel, so that runs started at
once never race for one, and kept across restarts), pinned to cores where that helps, awaited until
healthy, started again on the same ports (`restart`), stopped by their own handle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import yaml

from pipelinerl.common.health import wait_until_serving
from pipelinerl.common.log import get_logger
from pipelinerl.launcher.ports import hold_port

log = get_logger(__name__)


@dataclass(frozen=True)
class Command:
    """How a service was started, so that it can be started again the same way."""

    module: str
    config_path: Path
    cores: set[int] | None
    python: str
    ranks: int
    nice: int


@dataclass
class ServiceProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    ready_file: Path
    """Where the service writes the ports it bound, once it serves."""
    command: Command
    port: int = 0
    """The gRPC port, known once `wait_healthy` has returned."""
    metrics_port: int | None = None
    """Where the service serves `/metrics`, if it does (known with `port`)."""
    held: tuple[socket.socket, ...] = ()
    """The launcher's sockets on the service's ports (`hold_port`), closed once it has stopped."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def wait_healthy(self, timeout_s: float, tls_ca_file: Path | None = None) -> None:
        """Until the service has bound its ports and is SERVING, verified with `tls_ca_file` when it
        speaks TLS; RuntimeError with the end of its log if it is not within `timeout_s`, or as soon
        as it exits."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.ready_file.exists() and self.process.poll() is None:
            if asyncio.get_running_loop().time() > deadline:
                self._failed(f"did not serve within {timeout_s}s")
            await asyncio.sleep(0.1)
        if self.process.poll() is not None:
            self._failed(f"exited with status {self.process.poll()}")
        self._read_ports()
        left = max(deadline - asyncio.get_running_loop().time(), 1.0)
        serving = asyncio.ensure_future(
            wait_until_serving(self.address, timeout_s=left, tls_ca_file=tls_ca_file)
        )
        while not serving.done() and self.process.poll() is None:
            await asyncio.wait([serving], timeout=0.5)
        if serving.done() and serving.result():
            return
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        code = self.process.poll()
        self._failed(
            f"did not become healthy within {timeout_s}s" if code is None else f"exited with status {code}"
        )

    def _read_ports(self) -> None:
        """From the ready file: `host:port`, then `metrics host:port` when it serves /metrics."""
        first, *rest = self.ready_file.read_text().split("\n")
        self.port = int(first.rsplit(":", 1)[1])
        for line in rest:
            if line.startswith("metrics "):
                self.metrics_port = int(line.rsplit(":", 1)[1])

    def _failed(self, why: str) -> NoReturn:
        raise RuntimeError(f"{self.name} {why}; its log ends:\n{self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        """The end of the service's log (every start of it appends to the same file)."""
        if not self.log_path.exists():
            return ""
        with self.log_path.open("rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - chars, 0))
            return f.read().decode(errors="replace")

    def exit_reason(self) -> str | None:
        """`exited with status N` or `killed by SIGNAME`, None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"

    def restart(self) -> ServiceProcess:
        """The same service started again from its config file, on the ports it bound (its clients
        know it by that address, and Prometheus by its metrics port). Call once this one is gone.
        The new handle knows those ports at once, so a restart that dies before it serves (and
        so before `wait_healthy` reads its ready file) passes them on to the next."""
        config = yaml.safe_load(self.command.config_path.read_text())
        config["port"] = self.port
        if self.metrics_port is not None:
            config["metrics_port"] = self.metrics_port
        c = self.command
        again = start_service(
            self.name, c.module, config, self.log_path.parent, c.cores, c.python, c.ranks, c.nice, self.held
        )
        again.port, again.metrics_port = self.port, self.metrics_port
        return again

    def cpu_seconds(self) -> float:
        """User + system CPU time the process has used so far (Linux /proc), 0 once it is gone."""
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM (the service drains), then SIGKILL after `grace_s`; only this process, by handle."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                log.warning("service did not stop in time; killing it", service=self.name)
                self.process.kill()
                self.process.wait()
        for held in self.held:
            held.close()
        return self.process.returncode


def start_service(
    name: str,
    module: str,
    settings: dict[str, Any],
    run_dir: Path,
    cores: set[int] | None = None,
    python: str = sys.executable,
    ranks: int = 1,
    nice: int = 0,
    held: tuple[socket.socket, ...] | None = None,
) -> ServiceProcess:
    """`python -m <module> --config <run_dir>/<name>.yaml`, logging to `<run_dir>/<name>.log`; with
    `ranks` > 1, that many copies under torchrun (which forwards SIGTERM to each; rank 0 serves).
    The CPU seconds of torchrun's ranks count once they have exited. `nice` > 0 lowers its
    scheduling priority: it then runs mostly on CPU time the others leave idle. Its ports (`port`,
    and `metrics_port` when set; 0 for one the kernel picks) are held from here (`hold_port`), or
    by `held` when it is started again on them."""
    ready_file = run_dir / f"{name}.address"
    ready_file.unlink(missing_ok=True)  # a resumed run's: the new process writes its own
    config = {
        **settings,
        "port": settings.get("port") or 0,
        "host": "127.0.0.1",
        "ready_file": str(ready_file),
    }
    if held is None:
        held = _hold_ports(config)
    config_path = run_dir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = run_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    threads = settings.get("threads")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            [*_launcher(python, ranks), "-m", module, "--config", str(config_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
        )
    # Pinned and niced from here, not by a `preexec_fn`: Python code between fork and exec crashes
    # the child (SIGSEGV) about one time in five while gRPC's threads run in this process, as they
    # do when the supervisor restarts a service. Popen returns once the child has exec'd, before its
    # interpreter starts a thread of its own, so every thread it starts inherits both.
    with contextlib.suppress(ProcessLookupError):  # it died already: its exit tells why
        if cores:
            os.sched_setaffinity(process.pid, cores)
        if nice:
            os.setpriority(os.PRIO_PROCESS, process.pid, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    log.info("started", service=name, pid=process.pid, cores=sorted(cores) if cores else "any", nice=nice)
    command = Command(module, config_path, cores, python, ranks, nice)
    return ServiceProcess(name, process, log_path, ready_file, command, held=held)


def _hold_ports(config: dict[str, Any]) -> tuple[socket.socket, ...]:
    """Hold the ports `config` names (0: one the kernel picks) and write the held ones into it."""
    held: list[socket.socket] = []
    try:
        for key in ("port", "metrics_port"):
            if config.get(key) is not None:
                held.append(hold_port(config["host"], config[key]))
                config[key] = held[-1].getsockname()[1]
    except OSError:
        for socket_ in held:
            socket_.close()
        raise
    return tuple(held)


async def stop_all(processes: list[ServiceProcess]) -> dict[str, float]:
    """Stop in reverse start order (the coordinator first, so nothing new is dispatched); returns
    the CPU seconds each service used, read just before it was stopped. It runs to its end even when
    its caller is cancelled meanwhile (a signal during teardown), so that no service outlives it."""
    cpu = {service.name: round(service.cpu_seconds(), 2) for service in processes}
    stopping = asyncio.ensure_future(asyncio.to_thread(_stop_in_turn, processes))
    while not stopping.done():
        try:
            await asyncio.shield(stopping)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # this teardown is what the cancellation asked for
    stopping.result()
    return cpu


def _stop_in_turn(processes: list[ServiceProcess]) -> None:
    for service in reversed(processes):
        code = service.stop()
        log.info("stopped", service=service.name, exit_code=code)


def write_targets(path: Path, processes: list[ServiceProcess]) -> None:
    """The services' `/metrics` addresses as a Prometheus file_sd list (`job`: the service's role,
    `instance`: its name), for a local Prometheus to scrape during the run."""
    targets = [
        {
            "targets": [f"127.0.0.1:{p.metrics_port}"],
            "labels": {"job": p.name.split("-")[0], "instance": p.name},
        }
        for p in processes
        if p.metrics_port is not None
    ]
    path.write_text(json.dumps(targets, indent=2) + "\n")


def _launcher(python: str, ranks: int) -> list[str]:
    if ranks == 1:
        return [python]
    # --standalone: the rendezvous binds a free port of its own choosing
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
