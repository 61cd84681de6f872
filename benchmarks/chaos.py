"""Chaos soak: a `pipelinerl run` (pipeline mode, two inference servers, two reward replicas) whose
services are SIGKILLed or frozen (SIGSTOP, then SIGCONT) at random times, while a fault proxy in
front of each service (benchmarks/fault_proxy.py) adds latency to, stalls, resets or drops the
connections the others make to it. The launcher's supervisor restarts what dies or stops answering.
At the end the run must have completed, every attempt be final and each trained one be in the final
weights exactly once (tests/e2e/evidence.py), and no process or listening port of the run be left.

    python -m benchmarks.chaos [--duration-s 600] [--seed 0] [--out DIR]
                               [--samples N] [--short] [--limit-s S]

First a quiet run: the same services behind the same proxies, no fault, stopped after
`--duration-s`. Then the chaos run, with the attempts the quiet run trained in that time as its
budget; faults start at its first trained sample and end with it: a process fault (`kill` or
`freeze` for 5-30 s) every 20-60 s, on one of the coordinator, the trainer, the inference servers
and the reward replicas, and a network fault (`latency` of 50-500 ms a chunk, `stall`, `reset`,
`drop`, each on for 3-20 s) every 20-60 s, on one of their proxies. `--samples N` skips the quiet
run and makes N the budget; `--short` (CI) faults every 3-8 s, freezes 1-7 s and windows 1-5 s,
with a supervisor that looks every 0.5 s and restarts after 4 s without an answer. The chaos run is
stopped, and fails, past `--limit-s`. The supervisor may restart a service 30 times in its window
here, not 5: the soak kills services faster than the default expects a real one to die.

Ends with one JSON line: `seed`; `budget` (attempts); `state` (the chaos run's end: `completed`);
`duration_s` (the chaos run's wall time, StartRun to its end); `trained` (the run's own count, which
must equal the journal's); `faults` (by kind), `faulted` (by service); `restarts` (by service, the
supervisor's: a freeze past its patience is one); `samples_per_s` (trained over `duration_s`);
`quiet_samples_per_s` (trained over the quiet run's time at its last report before its stop) and
`quiet_s`; `ratio` (the first over the second); `time_lost_s` (`duration_s` minus the quiet run's
time for as many trained samples: what the faults cost); `stalled_s` (the chaos run's seconds in
stretches of at least 5 s with no newly trained sample); `trained_exactly_once` and `dispositions`
(attempts per final disposition), or `evidence_error`; `leaked_processes` (command lines of the
run's processes, and their descendants, still alive 15 s after the run) and `leaked_ports` (service
and proxy ports still listened on); `load_average` (at the start and the end: the machine is shared)
and `cores`. The quiet figures are null with `--samples`. Exits 1 unless the run completed, exactly
once, counted right, with nothing leaked.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.fault_proxy import Fault, FaultProxy
from benchmarks.leaks import Tracker
from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.coordinator.types import RunInfo, RunState
from pipelinerl.launcher.config import RestartPolicy, RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch
from tests.e2e.evidence import assert_trained_exactly_once

log = get_logger("chaos")

STALL_S = 5.0
GROUP = RunSettings.model_fields["group_size"].default


@dataclass(frozen=True)
class Schedule:
    """Ranges (low, high) the faults' times are drawn from, uniformly."""

    gap_s: tuple[float, float]
    """Between two process faults, and between two network faults."""
    freeze_s: tuple[float, float]
    window_s: tuple[float, float]
    """How long a network fault stays on."""
    delay_s: tuple[float, float]
    """Latency a chunk gets."""
    restart: RestartPolicy
    """The supervisor's."""


LONG = Schedule((20, 60), (5, 30), (3, 20), (0.05, 0.5), RestartPolicy(max_restarts=30))
QUICK = RestartPolicy(
    max_restarts=30, window_s=60, health_every_s=0.5, unhealthy_after_s=4, backoff_initial_s=0.2
)
SHORT = Schedule((3, 8), (1, 7), (1, 5), (0.05, 0.3), QUICK)


class Proxies:
    """The launcher's route: a fault proxy in front of each service, made as the launcher asks."""

    def __init__(self) -> None:
        self.by_name: dict[str, FaultProxy] = {}
        self._starting: list[asyncio.Future[None]] = []

    def route(self, name: str, real: Callable[[], str | None]) -> str:
        proxy = self.by_name[name] = FaultProxy(real)
        self._starting.append(asyncio.ensure_future(proxy.start()))
        return proxy.address

    async def close(self) -> None:
        await asyncio.gather(*self._starting, return_exceptions=True)
        for proxy in self.by_name.values():
            await proxy.close()


class Chaos:
    """Process faults and network faults, each on its own random clock, from `begin` to `end`."""

    def __init__(
        self, schedule: Schedule, seed: int, processes: list[ServiceProcess], proxies: Proxies, log_path: Path
    ) -> None:
        self._schedule = schedule
        self._rng = random.Random(seed)
        self._processes = processes
        self._proxies = proxies
        self._log_path = log_path
        self._frozen: dict[int, asyncio.Task[None]] = {}
        self.faults: Counter[str] = Counter()
        self.faulted: Counter[str] = Counter()

    async def run(self, begin: asyncio.Event, end: asyncio.Event) -> None:
        await begin.wait()
        loops = [asyncio.ensure_future(self._process_faults()), asyncio.ensure_future(self._network_faults())]
        try:
            await end.wait()
        finally:
            tasks = [*loops, *self._frozen.values()]
            for task in tasks:
                task.cancel()  # each frozen process is resumed, each proxy's fault switched off
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _process_faults(self) -> None:
        while True:
            await asyncio.sleep(self._rng.uniform(*self._schedule.gap_s))
            # A service being restarted has no process to fault; a frozen one is left to its thaw.
            up = [
                p for p in self._processes if p.process.poll() is None and p.process.pid not in self._frozen
            ]
            if not up:
                continue
            victim = self._rng.choice(up)
            if self._rng.random() < 0.5:
                victim.process.kill()  # by handle
                self._record("kill", victim.name, f"pid {victim.process.pid}")
            else:
                seconds = self._rng.uniform(*self._schedule.freeze_s)
                self._frozen[victim.process.pid] = asyncio.ensure_future(self._freeze(victim, seconds))

    async def _freeze(self, victim: ServiceProcess, seconds: float) -> None:
        victim.process.send_signal(signal.SIGSTOP)
        self._record("freeze", victim.name, f"pid {victim.process.pid} for {seconds:.1f}s")
        try:
            await asyncio.sleep(seconds)
        finally:
            del self._frozen[victim.process.pid]
            victim.process.send_signal(signal.SIGCONT)  # nothing once the supervisor has reaped it

    async def _network_faults(self) -> None:
        while True:
            await asyncio.sleep(self._rng.uniform(*self._schedule.gap_s))
            name = self._rng.choice(sorted(self._proxies.by_name))
            fault = self._rng.choice(list(Fault))
            seconds = self._rng.uniform(*self._schedule.window_s)
            delay = self._rng.uniform(*self._schedule.delay_s)
            proxy = self._proxies.by_name[name]
            proxy.set_fault(fault, delay)
            extra = f", {delay * 1000:.0f} ms a chunk" if fault is Fault.LATENCY else ""
            self._record(fault.value, name, f"for {seconds:.1f}s{extra}")
            try:
                await asyncio.sleep(seconds)
            finally:
                proxy.set_fault(None)

    def _record(self, kind: str, service: str, detail: str) -> None:
        self.faults[kind] += 1
        self.faulted[service] += 1
        line = f"{kind} {service} ({detail})"
        log.info(line)
        with self._log_path.open("a") as f:
            f.write(f"{datetime.now(UTC).isoformat(timespec='milliseconds')} {line}\n")


class Progress:
    """The run's progress reports: when it first trained, when it ended, how long it stood still."""

    def __init__(self) -> None:
        self.began, self.ended = asyncio.Event(), asyncio.Event()
        self.last = (0.0, 0)
        """(seconds into the run, trained) at the last report while it ran."""
        self.stalled_s = 0.0
        self._moved_at = 0.0

    def on_progress(self, run: RunInfo, elapsed_s: float) -> None:
        trained = run.progress.trained
        if trained > self.last[1]:
            if elapsed_s - self._moved_at >= STALL_S:
                self.stalled_s += elapsed_s - self._moved_at
            self._moved_at = elapsed_s
            self.began.set()
        if run.state is RunState.RUNNING:
            self.last = (elapsed_s, trained)
        if run.state.final:
            self.ended.set()


def settings(run_dir: Path, seed: int, samples: int, duration_s: float, schedule: Schedule) -> RunSettings:
    return RunSettings(
        run_dir=run_dir, seed=seed, max_samples=samples, duration_s=duration_s,
        inference_servers=2, reward_servers=2, restart=schedule.restart,
    )  # fmt: skip


async def quiet_run(run_dir: Path, seed: int, duration_s: float, schedule: Schedule) -> tuple[float, int]:
    """(seconds, trained) at the quiet run's last report before its stop."""
    proxies, progress = Proxies(), Progress()
    quiet = settings(run_dir, seed, 0, duration_s, schedule)
    try:
        await launch(quiet, progress.on_progress, route=proxies.route)
    finally:
        await proxies.close()
    return progress.last


async def chaos_run(
    run_dir: Path, seed: int, budget: int, limit_s: float, schedule: Schedule
) -> dict[str, Any]:
    processes: list[ServiceProcess] = []
    proxies, progress, tracker = Proxies(), Progress(), Tracker(processes)
    chaos = Chaos(schedule, seed, processes, proxies, run_dir / "chaos.log")
    tasks = [asyncio.ensure_future(t) for t in (tracker.run(), chaos.run(progress.began, progress.ended))]
    run = settings(run_dir, seed, budget, limit_s, schedule)
    try:
        result = await launch(run, progress.on_progress, processes, route=proxies.route)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await proxies.close()
    figures: dict[str, Any] = {
        "state": result.state, "duration_s": round(result.elapsed_s, 1), "trained": result.trained,
        "faults": dict(chaos.faults), "faulted": dict(chaos.faulted), "restarts": result.restarts,
        "samples_per_s": round(result.samples_per_s, 1), "stalled_s": round(progress.stalled_s, 1),
    }  # fmt: skip
    try:
        dispositions = assert_trained_exactly_once(run_dir, budget)
        figures |= {"trained_exactly_once": True, "dispositions": dict(dispositions)}
    except AssertionError as exc:
        figures |= {"trained_exactly_once": False, "evidence_error": str(exc)[:2000]}
    ports = [proxy.port for proxy in proxies.by_name.values()]
    return figures | await tracker.leaks(ports)


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    schedule = SHORT if args.short else LONG
    out = Path(args.out)
    figures: dict[str, Any] = {"seed": args.seed, "load_average": [round(os.getloadavg()[0], 2)]}
    quiet = None if args.samples else await quiet_run(out / "quiet", args.seed, args.duration_s, schedule)
    budget = args.samples if quiet is None else max(quiet[1] // GROUP * GROUP, GROUP)
    figures |= {"budget": budget} | await chaos_run(out / "chaos", args.seed, budget, args.limit_s, schedule)
    figures |= dict.fromkeys(["quiet_samples_per_s", "quiet_s", "ratio", "time_lost_s"])
    if quiet is not None:
        quiet_s, quiet_trained = quiet
        rate = quiet_trained / quiet_s
        figures |= {
            "quiet_samples_per_s": round(rate, 1), "quiet_s": round(quiet_s, 1),
            "ratio": round(figures["samples_per_s"] / rate, 3),
            "time_lost_s": round(figures["duration_s"] - figures["trained"] / rate, 1),
        }  # fmt: skip
    figures["load_average"].append(round(os.getloadavg()[0], 2))
    return figures | {"cores": len(os.sched_getaffinity(0))}


def passed(figures: dict[str, Any]) -> bool:
    return (
        figures["state"] == RunState.COMPLETED.value
        and figures["trained_exactly_once"]
        and figures["trained"] == figures["dispositions"]["trained"]
        and not figures["leaked_processes"]
        and not figures["leaked_ports"]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--duration-s", type=float, default=600.0, help="the quiet run's length")
    parser.add_argument("--seed", type=int, default=0, help="the runs' and the faults' seed")
    parser.add_argument("--samples", type=int, default=0, help="the chaos run's budget; skips the quiet run")
    parser.add_argument("--short", action="store_true", help="faults every few seconds (CI)")
    parser.add_argument("--limit-s", type=float, default=3600.0, help="the chaos run fails past this")
    parser.add_argument("--out", default=None, help="a new folder (default: runs/chaos/<time>)")
    args = parser.parse_args(argv)
    args.out = args.out or f"runs/chaos/{time.strftime('%Y%m%d-%H%M%S')}"
    if args.samples % GROUP:
        parser.error(f"--samples must be a multiple of the group size, {GROUP}")
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        parser.error(f"{args.out} already holds a run; give a new folder")
    configure_logging("benchmark", "console", "info")
    figures = asyncio.run(soak(args))
    print(json.dumps(figures))
    return 0 if passed(figures) else 1


if __name__ == "__main__":
    sys.exit(main())
