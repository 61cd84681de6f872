"""How long each caller takes to notice a peer frozen with SIGSTOP (its sockets open, the kernel
still acking TCP, the process answering nothing) and to route its work around it, in a real run of
two inference servers and two reward replicas. The supervisor is kept out of it
(`restart.unhealthy_after_s` 600), as under Kubernetes or compose, where nothing kills a frozen peer.

    .venv/bin/python benchmarks/frozen_peers.py [--hold-s 30] [--trainer-hold-s 20] [--out DIR]

The trainer is frozen first, alone, then inference-1 and reward-1 together; each by pid, and
thawed (SIGCONT) once its caller has routed around it, or after `--hold-s`:

- trainer, frozen for `--trainer-hold-s`: `submitter_detected` is the coordinator's "trainer stream
  lost", `weights_detected` inference-0's "weight stream lost"; `submitter_back` is the time from
  SIGCONT until the trainer has trained again (the coordinator's stream is live again),
  `weights_back` until inference-0 has taken a version (its weight stream is live again).
- inference-1: `detected` is the coordinator's first log line about the server's stream, its
  requests or its registration lapsing; `routed` the time, from then on, its attempts in flight
  reach 0 (they run elsewhere).
- reward-1: `detected` is "reward replica down"; `routed` the time no Score call is in flight on
  it any more (a call it held was sent to the other replica).

Prints one line per callee and ends with one JSON line; seconds from the freeze (the thaw for
`*_back`); a figure that never came within the hold is null. `tests/e2e/test_frozen_peers.py`
runs the same phases against the bound docs/guarantees.md states.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RestartPolicy, RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import RunResult, launch

POLL_S = 0.1
BACK_S = 60.0
"""Longest wait for inference-1 to take work, and for a thawed trainer to be followed again."""

Figures = dict[str, float | None]


def first_line_at(log: Path, since: float, *needles: str) -> float | None:
    """Wall-clock time of the first line of `log` logged at or after `since` holding every needle."""
    for line in log.read_text(errors="replace").splitlines():
        if all(n in line for n in needles):
            with contextlib.suppress(ValueError):
                logged = datetime.fromisoformat(line.split(" ", 1)[0]).timestamp()
                if logged >= since:
                    return logged
    return None


async def until(check: Callable[[], float | None], limit_s: float) -> float | None:
    """The first answer of `check` that is not None, within `limit_s` (None past it)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if (found := check()) is not None:
            return found
        await asyncio.sleep(POLL_S)
    return None


def _since(t0: float, at: float | None) -> float | None:
    return None if at is None else round(at - t0, 2)


class Freezer:
    """Freezes the callees of a run started with `follow` as its progress callback (`phases`), and
    reads from the callers' logs and the coordinator's metrics when they noticed."""

    def __init__(self, run_dir: Path, processes: list[ServiceProcess], hold_s: float, trainer_hold_s: float):
        self.run_dir = run_dir
        self.processes = processes
        self.hold_s = hold_s
        self.trainer_hold_s = trainer_hold_s
        self.trained = 0

    def follow(self, run: RunInfo, elapsed_s: float) -> None:
        self.trained = run.progress.trained

    async def phases(self, running: asyncio.Future[RunResult], start_at: int) -> dict[str, Figures]:
        """Once `start_at` samples are trained: the trainer, then inference-1 and reward-1 at the
        same time (their callers are apart: the inference pool and the reward pool). `running` is
        the run's `launch`: if it ends first, with an error or not, so does this."""
        started = asyncio.ensure_future(until(lambda: True if self.trained >= start_at else None, 300))
        await asyncio.wait([running, started], return_when=asyncio.FIRST_COMPLETED)
        if not started.done():
            started.cancel()
            raise RuntimeError(f"the run ended before {start_at} samples were trained: {running.result()}")
        trainer = await self.freeze_trainer()
        inference, reward = await asyncio.gather(self.freeze_inference(), self.freeze_reward())
        return {"trainer": trainer, "inference": inference, "reward": reward}

    def thaw_all(self) -> None:
        """SIGCONT to every process of the run, so none stays frozen whatever happened."""
        for p in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.process.pid, signal.SIGCONT)

    def _process(self, name: str) -> ServiceProcess:
        return next(p for p in self.processes if p.name == name)

    def _gauge(self, name: str, label: str, value: str) -> float | None:
        """A sample of the coordinator's `/metrics` whose `label` is `value`."""
        port = self._process("coordinator").metrics_port
        assert port is not None, "the run serves no metrics"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == f"pipelinerl_coordinator_{name}" and sample.labels.get(label) == value:
                    return sample.value
        return None

    async def freeze_trainer(self) -> Figures:
        trainer, coordinator_log = self._process("trainer"), self.run_dir / "coordinator.log"
        inference_log = self.run_dir / "inference-0.log"
        t0 = time.time()
        os.kill(trainer.process.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.trainer_hold_s)
        finally:
            thawed, before = time.time(), self.trained
            os.kill(trainer.process.pid, signal.SIGCONT)
        trained = await until(lambda: time.time() if self.trained > before else None, BACK_S)
        weights = await until(lambda: first_line_at(inference_log, thawed, "weights updated"), BACK_S)
        return {
            "submitter_detected_s": _since(t0, first_line_at(coordinator_log, t0, "trainer stream lost")),
            "weights_detected_s": _since(t0, first_line_at(inference_log, t0, "weight stream lost")),
            "submitter_back_s": _since(thawed, trained),
            "weights_back_s": _since(thawed, weights),
        }

    async def freeze_inference(self) -> Figures:
        victim = self._process("inference-1")

        def busy() -> float | None:
            return self._gauge("server_in_flight", "server", victim.address) or None

        await until(busy, BACK_S)
        t0 = time.time()

        def detected() -> float | None:
            log = self.run_dir / "coordinator.log"
            needles = ("stream ended", "generation interrupted", "lease lapsed")
            found = [t for n in needles if (t := first_line_at(log, t0, n, victim.address)) is not None]
            return min(found, default=None)

        os.kill(victim.process.pid, signal.SIGSTOP)
        try:  # routed once detected: until then it may still be given attempts
            await until(detected, self.hold_s)
            routed = await until(
                lambda: time.time() if busy() is None else None, t0 + self.hold_s - time.time()
            )
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        return {"detected_s": _since(t0, detected()), "routed_s": _since(t0, routed)}

    async def freeze_reward(self) -> Figures:
        victim = self._process("reward-1")

        def up() -> bool:
            return self._gauge("reward_replica_up", "replica", victim.address) == 1

        def routed_around() -> float | None:
            held = self._gauge("reward_replica_in_flight", "replica", victim.address)
            return time.time() if not up() and held == 0 else None

        t0 = time.time()
        os.kill(victim.process.pid, signal.SIGSTOP)
        try:
            routed = await until(routed_around, self.hold_s)
        finally:
            os.kill(victim.process.pid, signal.SIGCONT)
        detected = first_line_at(self.run_dir / "coordinator.log", t0, "reward replica down", victim.address)
        return {"detected_s": _since(t0, detected), "routed_s": _since(t0, routed)}


async def measure(out: Path, hold_s: float, trainer_hold_s: float) -> dict[str, Figures]:
    """The phases in a run that goes on until they are done, then is stopped."""
    settings = RunSettings(
        run_dir=out,
        inference_servers=2,
        reward_servers=2,
        duration_s=900,
        restart=RestartPolicy(unhealthy_after_s=600),
    )
    processes: list[ServiceProcess] = []
    freezer = Freezer(out, processes, hold_s, trainer_hold_s)
    running = asyncio.ensure_future(launch(settings, freezer.follow, processes))
    try:
        figures = await freezer.phases(running, start_at=1024)
        coordinator = next(p for p in processes if p.name == "coordinator")
        async with CoordinatorClient(coordinator.address) as client:
            await client.stop_run(settings.run_id, timeout_s=120)
        await running
        return figures
    finally:
        freezer.thaw_all()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--hold-s", type=float, default=30.0, help="longest freeze of a server or replica")
    parser.add_argument("--trainer-hold-s", type=float, default=20.0, help="how long the trainer is frozen")
    default_out = Path("runs") / f"frozen_peers-{time.strftime('%Y%m%d-%H%M%S')}"
    parser.add_argument("--out", type=Path, default=default_out, help="run folder (a new one)")
    args = parser.parse_args()
    figures = asyncio.run(measure(args.out, args.hold_s, args.trainer_hold_s))
    for callee, values in figures.items():
        print(callee, " ".join(f"{k}={v}" for k, v in values.items()))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
