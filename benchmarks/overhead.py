"""CPU per trained sample of `pipelinerl run`, per service, in pipeline and in sync mode.

Each mode runs the default run (`builtin:copy:2`, the tiny preset, one inference server, one
reward replica) fresh in a folder of its own for a fixed wall-clock budget, through
`pipelinerl.launcher.run.launch` as `pipelinerl run` does. A service's CPU seconds are counted from
the run's first progress report (the services are up and healthy, their imports and model loads
done) to its last before it is stopped, for the process and its children (the reward service's
scoring workers), and divided by the samples trained in between: the steady cost of a sample.
`startup_cpu_s` is what came before (imports, model loads), reported apart.

    python benchmarks/overhead.py [--seconds 60] [--modes pipeline,sync] [--out DIR]
                                  [--profile] [--dataset builtin:copy:2] [--max-running N]

`--profile` records each service with py-spy (`py-spy record --format speedscope`, 50 Hz, into
`<run>/profile-<service>.json`) over the run; py-spy takes CPU of its own, so the figures of a
profiled run read high. A folder that already holds a run is refused (the launcher would resume it).

Ends with one JSON line: per mode, `<mode>_samples_per_s` (trained samples over the run's wall
time, as `pipelinerl run` reports it), `<mode>_steady_samples_per_s` (over the same window as
the CPU figures), `<mode>_trained`, `<mode>_seconds`,
`<mode>_cpu_ms_per_sample` ({service: ms, "total": ms}), `<mode>_cpu_s` ({service: CPU seconds
between the first and the last progress report}), `<mode>_startup_cpu_s`
({service: CPU seconds before the run}); `load_average` (1-minute load at the start and at the end:
the machine is shared) and `cores`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.coordinator.types import RunInfo
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch

log = get_logger("overhead")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and every live descendant (a reward service's
    scoring workers are processes of their own), from Linux /proc; 0 for what has gone."""
    total, stack = 0.0, [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        stack += [int(child) for child in children]
    return total


class Sampled:
    """Reads each service's CPU seconds (its process tree's) and the trained count on each progress
    report of the run, and optionally starts py-spy on each service at the first."""

    def __init__(self, run_dir: Path, profile: bool, seconds: float) -> None:
        self.run_dir = run_dir
        self.profile = profile
        self.seconds = seconds
        self.processes: list[ServiceProcess] = []
        self.readings: list[tuple[float, int, dict[str, float]]] = []
        """(seconds into the run, trained, {service: CPU seconds}) per progress report."""
        self.profilers: list[subprocess.Popen[bytes]] = []

    def on_progress(self, run: RunInfo, elapsed: float) -> None:
        cpu = {p.name: tree_cpu_seconds(p.process.pid) for p in self.processes}
        self.readings.append((elapsed, run.progress.trained, cpu))
        if self.profile and not self.profilers:
            self.profilers = [self._py_spy(p) for p in self.processes]

    def _py_spy(self, service: ServiceProcess) -> subprocess.Popen[bytes]:
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        command = [
            py_spy, "record", "--pid", str(service.process.pid), "--rate", "50", "--format", "speedscope",
            "--duration", str(int(self.seconds)), "--nonblocking",
            "--output", str(self.run_dir / f"profile-{service.name}.json"),
        ]  # fmt: skip
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop_profilers(self) -> None:
        for profiler in self.profilers:
            try:
                profiler.wait(timeout=30)
            except subprocess.TimeoutExpired:
                profiler.terminate()
                profiler.wait()


def run(mode: str, args: argparse.Namespace) -> dict[str, object]:
    run_dir = Path(args.out) / mode
    settings = RunSettings(
        mode="pipeline" if mode == "pipeline" else "sync",
        run_dir=run_dir,
        dataset=args.dataset,
        seed=args.seed,
        duration_s=args.seconds,
        eval=[],  # the cost of a trained sample alone; benchmarks/eval_cost.py measures evaluation's
        inference=InferenceSettings.model_construct(
            **({"max_running": args.max_running} if args.max_running else {})
        ),
    )
    sampled = Sampled(run_dir, args.profile, args.seconds)
    log.info("running", mode=mode, seconds=args.seconds)
    try:
        result = asyncio.run(launch(settings, on_progress=sampled.on_progress, processes=sampled.processes))
    finally:
        sampled.stop_profilers()
    if len(sampled.readings) < 2 or sampled.readings[-1][1] <= sampled.readings[0][1]:
        raise SystemExit(f"error: the {mode} run trained nothing; no figures")
    (t0, trained0, start), (t1, trained1, end) = sampled.readings[0], sampled.readings[-1]
    trained = trained1 - trained0
    during = {name: round(end[name] - start[name], 2) for name in end}
    per_sample = {name: round(1000 * cpu / trained, 3) for name, cpu in during.items()}
    per_sample["total"] = round(sum(per_sample.values()), 3)
    return {
        f"{mode}_samples_per_s": round(result.samples_per_s, 1),
        f"{mode}_steady_samples_per_s": round(trained / (t1 - t0), 1),
        f"{mode}_trained": result.trained,
        f"{mode}_seconds": round(result.elapsed_s, 1),
        f"{mode}_cpu_ms_per_sample": per_sample,
        f"{mode}_cpu_s": during,
        f"{mode}_startup_cpu_s": {name: round(cpu, 2) for name, cpu in start.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget of each run")
    parser.add_argument("--modes", default="pipeline,sync")
    parser.add_argument("--dataset", default=RunSettings.model_fields["dataset"].default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-running", type=int, default=0, help="the inference engine's batch rows (default: its own)"
    )
    parser.add_argument("--profile", action="store_true", help="py-spy each service (costs CPU)")
    parser.add_argument("--out", default=None, help="a new folder (default: runs/overhead/<time>)")
    args = parser.parse_args()
    args.out = args.out or f"runs/overhead/{time.strftime('%Y%m%d-%H%M%S')}"
    if Path(args.out).exists() and any(Path(args.out).iterdir()):
        parser.error(f"{args.out} already holds a run; give a new folder")
    configure_logging("benchmark", "console", "info")
    figures: dict[str, object] = {"load_average": [round(os.getloadavg()[0], 2)]}
    for mode in args.modes.split(","):
        figures |= run(mode, args)
    figures["load_average"] = [*figures["load_average"], round(os.getloadavg()[0], 2)]  # type: ignore[misc]
    cores = len(os.sched_getaffinity(0))
    figures |= {"cores": cores, "seconds_budget": args.seconds, "dataset": args.dataset}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
