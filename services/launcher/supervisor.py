"""Supervision of a local run's services, as Kubernetes or compose restart a dead container.

    every health_every_s, each service:  exited? ────────────────────────────────┐
                                         no health answer for unhealthy_after_s? ─┤
                                         NOT_SERVING for not_serving_after_s? ────┴─► SIGKILL (by handle)
        ─► wait backoff (doubling with each restart in window_s) ─► start again on its ports ─► healthy
    more than max_restarts in window_s ─► ServiceFailed: the service, why, the end of its log

A restarted service resumes its part by the guarantees each service already keeps (the journal, the
trainer's checkpoints, registration); the supervisor only brings the process back. Every restart and
its reason is a line of `<run_dir>/launcher.log` and of the launcher's own log.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from grpc_health.v1 import health_pb2_grpc

from pipelinerl.common.channel import ChannelConfig, open_channel
from pipelinerl.common.health import check
from pipelinerl.common.log import get_logger
from pipelinerl.launcher.config import RestartPolicy
from pipelinerl.launcher.processes import ServiceProcess

log = get_logger(__name__)

T = TypeVar("T")

CHECK_TIMEOUT_S = 2.0


class ServiceFailed(RuntimeError):
    """A service kept dying: more restarts within the policy's window than it allows."""


class Supervisor:
    """Watches the services in `processes` (the handles there when it is made) until cancelled;
    replaces a restarted one's handle in `processes`, in place, so the launcher stops the new one."""

    def __init__(
        self,
        processes: list[ServiceProcess],
        policy: RestartPolicy,
        run_dir: Path,
        start_timeout_s: float,
        tls_ca_file: Path | None = None,
        on_restart: Callable[[str, int], None] | None = None,
    ) -> None:
        self._processes = processes
        self._log_path = run_dir / "launcher.log"
        self._start_timeout_s = start_timeout_s
        self._policy = policy
        self._tls_ca_file = tls_ca_file
        self._on_restart = on_restart
        self._names = [p.name for p in processes]
        self.restarts: Counter[str] = Counter()
        """Restarts so far, by service name."""

    async def watch(self) -> None:
        """Until cancelled; ServiceFailed as soon as one service has died too often."""
        tasks = [asyncio.ensure_future(self._watch(name)) for name in self._names]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            next(iter(done)).result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def supervised(self, work: Awaitable[T]) -> T:
        """`work`'s result, the services watched meanwhile; ServiceFailed (and `work` cancelled) as
        soon as one has died too often. Nothing is restarted once `work` is done or failing."""
        working = asyncio.ensure_future(work)
        watching = asyncio.ensure_future(self.watch())
        try:
            await asyncio.wait([working, watching], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (watching, working):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if working.cancelled():  # the watch gave up on a service
            watching.result()  # raises its ServiceFailed
        return working.result()

    def _current(self, name: str) -> ServiceProcess:
        return next(p for p in self._processes if p.name == name)

    async def _watch(self, name: str) -> None:
        recent: deque[float] = deque()  # monotonic times of this service's restarts within the window
        address = self._current(name).address  # the same across restarts: it comes back on its port
        config = ChannelConfig(address, tls_ca_file=self._tls_ca_file, max_attempts=1)
        channel = open_channel(config)
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            serving_at = answered_at = time.monotonic()
            while True:
                await asyncio.sleep(self._policy.health_every_s)
                service = self._current(name)
                reason = service.exit_reason()
                if reason is None:
                    status = await check(stub, timeout_s=CHECK_TIMEOUT_S)
                    now = time.monotonic()
                    answered_at = now if status in ("SERVING", "NOT_SERVING") else answered_at
                    serving_at = now if status == "SERVING" else serving_at
                    reason = self._unhealthy(now - answered_at, now - serving_at, status)
                if reason is not None:
                    await self._restart(service, reason, recent)
                    serving_at = answered_at = time.monotonic()
        finally:
            await channel.close()

    def _unhealthy(self, silent_s: float, not_serving_s: float, status: str) -> str | None:
        """Why the service must be restarted, if it must, from how long it has not answered its
        health checks and how long it has not said SERVING."""
        if silent_s >= self._policy.unhealthy_after_s:
            return f"answered no health check for {self._policy.unhealthy_after_s:g}s (last: {status})"
        if not_serving_s >= self._policy.not_serving_after_s:
            return f"not SERVING for {self._policy.not_serving_after_s:g}s (last: {status})"
        return None

    async def _restart(self, service: ServiceProcess, reason: str, recent: deque[float]) -> None:
        now = time.monotonic()
        while recent and now - recent[0] > self._policy.window_s:
            recent.popleft()
        if len(recent) >= self._policy.max_restarts:
            window = self._policy.window_s
            gave_up = f"{service.name} {reason}, after {len(recent)} restarts within {window:g}s"
            self._record(f"{gave_up}; giving up")
            raise ServiceFailed(f"{gave_up}; its log ends:\n{service.log_tail()}")
        if service.process.poll() is None:  # frozen or unhealthy: nothing of it may linger on its ports
            service.process.kill()
            await asyncio.to_thread(service.process.wait)
            reason = f"{reason}; killed"
        delay = min(self._policy.backoff_initial_s * 2 ** len(recent), self._policy.backoff_max_s)
        recent.append(now)
        self.restarts[service.name] += 1
        self._record(f"{service.name} {reason}; restart {self.restarts[service.name]} in {delay:g}s")
        if self._on_restart is not None:
            self._on_restart(service.name, self.restarts[service.name])
        await asyncio.sleep(delay)
        restarted = service.restart()
        self._processes[self._processes.index(service)] = restarted
        try:
            await restarted.wait_healthy(self._start_timeout_s, self._tls_ca_file)
        except RuntimeError as exc:  # it died again on its way up: the next check restarts it
            why, *log_tail = str(exc).splitlines()
            last = next((line for line in reversed(log_tail) if line.strip()), "")
            self._record(f"{service.name} restart failed: {why} {last.strip()}")
            return
        self._record(f"{service.name} serving again (pid {restarted.process.pid})")

    def _record(self, line: str) -> None:
        log.warning(line)
        with self._log_path.open("a") as f:
            f.write(f"{datetime.now(UTC).isoformat(timespec='milliseconds')} {line}\n")
