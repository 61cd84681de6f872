"""What held-out evaluation costs a run's training throughput.

The default run (`builtin:copy:2`, the tiny preset, pipeline mode) runs for a fixed wall-clock
budget without evaluation and with an evaluation of 264 completions (its 11 held-out problems, 24
completions each at temperature 1) every 16 versions, the two back to back per seed, in
alternating order from one seed to the next so that drift on a shared machine falls on both alike.
Throughput is trained samples per second over the run, as `pipelinerl run` reports it.

    python benchmarks/eval_cost.py [--seconds 60] [--seeds 0,1,2] [--out DIR]
                                   [--every 16] [--k 24]

Ends with one JSON line: `samples_per_s_without` and `samples_per_s_with` (means over seeds),
`throughput_ratio` (with / without, the mean of the per-seed ratios) and `throughput_drop`
(1 - ratio), `ratios` (per seed), `evaluations_per_run`, `completions_per_evaluation`,
`evaluation_seconds_mean` (one evaluation, first request to last score) and `seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
from pathlib import Path

from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.report import read_evaluations
from pipelinerl.launcher.run import RunResult, launch

log = get_logger("eval_cost")
HELD_OUT = "builtin:copy:2"


def run(args: argparse.Namespace, seed: int, evaluate: bool) -> tuple[RunResult, list[dict[str, float]]]:
    run_dir = Path(args.out) / f"{'with' if evaluate else 'without'}-s{seed}"
    settings = RunSettings(
        run_dir=run_dir,
        seed=seed,
        duration_s=args.seconds,
        target_reward=None,
        eval=[HELD_OUT] if evaluate else [],
        eval_every=args.every,
        eval_k=args.k,
        eval_temperature=1.0,
    )
    log.info("running", seed=seed, evaluate=evaluate, seconds=args.seconds)
    result = asyncio.run(launch(settings))
    return result, [e.evaluation for e in read_evaluations(result.metrics_path)]


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget of each run")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--every", type=int, default=16, help="versions between evaluations")
    parser.add_argument("--k", type=int, default=24, help="completions per held-out problem")
    parser.add_argument("--out", default="runs/eval-cost")
    args = parser.parse_args()
    configure_logging("benchmark", "console", "info")
    if Path(args.out).exists():
        shutil.rmtree(args.out)
    seeds = [int(s) for s in args.seeds.split(",")]
    without, with_, ratios, evaluations = [], [], [], []
    for position, seed in enumerate(seeds):
        order = (False, True) if position % 2 == 0 else (True, False)
        rates: dict[bool, float] = {}
        for evaluate in order:
            result, evaluated = run(args, seed, evaluate)
            rates[evaluate] = result.samples_per_s
            if evaluate:
                evaluations.append(evaluated)
        without.append(rates[False])
        with_.append(rates[True])
        ratios.append(rates[True] / rates[False])
    flat = [e for run_evaluations in evaluations for e in run_evaluations]
    ratio = statistics.fmean(ratios)
    figures = {
        "samples_per_s_without": round(statistics.fmean(without), 1),
        "samples_per_s_with": round(statistics.fmean(with_), 1),
        "throughput_ratio": round(ratio, 4),
        "throughput_drop": round(1 - ratio, 4),
        "ratios": [round(r, 4) for r in ratios],
        "evaluations_per_run": round(statistics.fmean(len(e) for e in evaluations), 1),
        "completions_per_evaluation": flat[0]["problems"] * flat[0]["samples_per_problem"] if flat else 0,
        "evaluation_seconds_mean": round(statistics.fmean(e["duration_s"] for e in flat), 3) if flat else 0.0,
        "seconds": args.seconds,
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
