"""Pipeline (in-flight updates) against the conventional sync baseline, on the same services.

Both runs use the same task, seed, model, learning rate, group size, samples per optimizer step
and sample budget; only the overlap differs. Fairness on CPU: pipeline mode pins inference and
trainer to separate cores with one thread each; sync mode gives each phase every core (its phases
never run at once). The launcher does this placement; see `pipelinerl.launcher.run`.

    python benchmarks/pipeline_vs_sync.py [--samples 40960] [--target 0.6] [--lr 3e-4]
                                          [--dataset builtin:copy:2] [--model tiny]
                                          [--max-new-tokens 3]

Each invocation starts both runs fresh in a folder of its own (`--out`, by default a new
timestamped folder under runs/pipeline_vs_sync/): a folder that already holds a run is refused,
since the launcher would resume that run from its journal and measure nothing. A run that did not
complete its budget from scratch is an error (exit 1), never a line of figures.

Ends with one JSON line: pipeline_samples_per_s, sync_samples_per_s, throughput_ratio,
pipeline_time_to_reward_s, sync_time_to_reward_s, time_to_reward_ratio, final_reward_pipeline,
final_reward_sync, mean_lag, ess; plus the target, sustained_time_to_reward_ratio (crossings of the
mean over the last 4,096 samples), final_reward_*_last_8192 (mean over the last 8,192 samples),
throughput_ceiling (sync wall time × cores / the pipeline's CPU seconds: the most overlap can gain
on this machine), per-phase trainer timings and CPU seconds per service.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import RunResult, launch

log = get_logger("benchmark")

SUSTAIN_SAMPLES = 4096
FINAL_SAMPLES = 8192


class NoFigures(Exception):
    """A run that cannot be measured: it resumed, failed, or trained nothing."""


def fresh_folder(out: Path) -> Path:
    """`out`, which must not hold anything yet: a run folder is resumed, not restarted."""
    if out.exists() and any(out.iterdir()):
        raise NoFigures(f"{out} holds an earlier run, which would resume from its journal; pass a new --out")
    return out


def check_run(result: RunResult, points: list[dict[str, float]], samples: int) -> None:
    """A completed run of `samples` attempts, measured from its start: progress points from the
    first trained samples on, and wall time for each of them."""
    if result.state != "completed":
        raise NoFigures(f"the {result.mode} run ended {result.state}, not completed")
    if result.trained <= 0 or len(points) < 2 or points[0]["trained"] >= samples:
        raise NoFigures(f"the {result.mode} run has no progress of its own ({len(points)} points)")
    if result.elapsed_s < 1:
        raise NoFigures(
            f"the {result.mode} run took {result.elapsed_s:.1f} s: it did not train its budget itself"
        )


def trainer_means(run_dir: Path) -> dict[str, float]:
    """Mean ESS and per-phase seconds of the trainer's optimizer steps (`wait_s`: waiting for data,
    which in sync mode is the generate-and-score phase of each round)."""
    lines = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    keys = ("ess", "wait_s", "forward_backward_s", "optimizer_s", "publish_s", "step_s")
    return {key: statistics.fmean(line[key] for line in lines) for key in keys}


def cpu_seconds(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "cpu_seconds.json").read_text())


def run(mode: Literal["pipeline", "sync"], args: argparse.Namespace) -> tuple[RunResult, dict[str, float]]:
    run_dir = Path(args.out) / mode
    settings = RunSettings(
        mode=mode,
        run_dir=run_dir,
        dataset=args.dataset,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        lr=args.lr,
        max_samples=args.samples,
        duration_s=args.max_seconds,
        target_reward=None,
    )
    log.info("running", mode=mode, samples=args.samples)
    result = asyncio.run(launch(settings))
    log.info("done", mode=mode, seconds=round(result.elapsed_s, 1), reward=round(result.final_reward, 3))
    check_run(result, progress_points(result), args.samples)
    return result, trainer_means(run_dir)


def progress_points(result: RunResult) -> list[dict[str, float]]:
    """The run's metrics.jsonl: one progress point per second (elapsed_s, trained, reward, ...)."""
    return [json.loads(line) for line in result.metrics_path.read_text().splitlines()]


def time_to(result: RunResult, target: float) -> float | None:
    """First time the reward (the coordinator's moving mean of the last 256 samples) reaches `target`."""
    points = progress_points(result)
    return next((p["elapsed_s"] for p in points if p["trained"] > 0 and p["reward"] >= target), None)


def time_to_sustained(result: RunResult, target: float, span: int = SUSTAIN_SAMPLES) -> float | None:
    """First time the mean of the reward points over the last `span` trained samples reaches
    `target`: less sensitive to one lucky window than `time_to`."""
    points = progress_points(result)
    for i, point in enumerate(points):
        window = [p["reward"] for p in points[: i + 1] if p["trained"] > point["trained"] - span]
        if point["trained"] >= span and statistics.fmean(window) >= target:
            return point["elapsed_s"]
    return None


def final_mean(result: RunResult, span: int = FINAL_SAMPLES) -> float:
    """Mean of the reward points over the last `span` trained samples (steadier than the last point)."""
    points = progress_points(result)
    last = points[-1]["trained"]
    return statistics.fmean(p["reward"] for p in points if p["trained"] > max(last - span, 0))


def throughput_ceiling(out: Path, sync_seconds: float) -> float:
    """The most the pipeline could gain with every core busy: sync wall time × cores over the CPU
    seconds the pipeline needed for the same samples."""
    return sync_seconds * len(os.sched_getaffinity(0)) / sum(cpu_seconds(out / "pipeline").values())


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--samples", type=int, default=40960, help="trained samples per run")
    parser.add_argument("--target", type=float, default=0.6, help="reward for time-to-reward")
    parser.add_argument("--dataset", default="builtin:copy:2")
    parser.add_argument("--model", default=RunSettings.model_fields["model"].default)
    defaults = RunSettings.model_fields
    parser.add_argument("--max-new-tokens", type=int, default=defaults["max_new_tokens"].default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=RunSettings.model_fields["lr"].default)
    parser.add_argument("--max-seconds", type=float, default=900.0, help="cap on each run")
    parser.add_argument("--out", default=None, help="a new folder (default: runs/pipeline_vs_sync/<time>)")
    args = parser.parse_args()
    args.out = args.out or f"runs/pipeline_vs_sync/{time.strftime('%Y%m%d-%H%M%S')}"
    configure_logging("benchmark", "console", "info")
    try:
        fresh_folder(Path(args.out))
        pipeline, pipeline_trainer = run("pipeline", args)
        sync, sync_trainer = run("sync", args)
    except NoFigures as exc:
        print(f"error: {exc}; no figures", file=sys.stderr)
        return 1
    t_pipeline, t_sync = time_to(pipeline, args.target), time_to(sync, args.target)
    figures = {
        "pipeline_samples_per_s": round(pipeline.samples_per_s, 1),
        "sync_samples_per_s": round(sync.samples_per_s, 1),
        "throughput_ratio": round(pipeline.samples_per_s / sync.samples_per_s, 2),
        "target_reward": args.target,
        "pipeline_time_to_reward_s": t_pipeline,
        "sync_time_to_reward_s": t_sync,
        "time_to_reward_ratio": ratio(t_sync, t_pipeline),
        "sustained_time_to_reward_ratio": ratio(
            time_to_sustained(sync, args.target), time_to_sustained(pipeline, args.target)
        ),
        "throughput_ceiling": round(throughput_ceiling(Path(args.out), sync.elapsed_s), 2),
        "final_reward_pipeline": round(pipeline.final_reward, 3),
        "final_reward_sync": round(sync.final_reward, 3),
        "final_reward_pipeline_last_8192": round(final_mean(pipeline), 3),
        "final_reward_sync_last_8192": round(final_mean(sync), 3),
        "mean_lag": round(pipeline.mean_lag, 2),
        "ess": round(pipeline_trainer["ess"], 3),
        "sync_ess": round(sync_trainer["ess"], 3),
        "samples": args.samples,
        "lr": args.lr,
        "dataset": args.dataset,
        "model": args.model,
        "max_new_tokens": args.max_new_tokens,
        "pipeline_trainer_step_s": round(pipeline_trainer["step_s"], 4),
        "sync_trainer_step_s": round(sync_trainer["step_s"], 4),
        "pipeline_trainer_wait_s": round(pipeline_trainer["wait_s"], 4),
        "sync_trainer_wait_s": round(sync_trainer["wait_s"], 4),
        "pipeline_seconds": round(pipeline.elapsed_s, 1),
        "sync_seconds": round(sync.elapsed_s, 1),
        # Where the CPU went: seconds of CPU per service over each run (two cores available).
        "pipeline_cpu_s": cpu_seconds(Path(args.out) / "pipeline"),
        "sync_cpu_s": cpu_seconds(Path(args.out) / "sync"),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
