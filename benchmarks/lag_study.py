"""What one version of lag costs per sample, against the size of each optimizer step, with the
off-policy corrections next to it: a grid of `benchmarks/single_process.py` runs.

    python -m benchmarks.lag_study --out lag-study.jsonl [--tasks copy,repeat] [--lrs 1e-4,3e-4,1e-3,3e-3]
        [--lags 0,1,2] [--seeds 8] [--losses default,decoupled,m2po,token_bound] [--in-flight]
        [--workers 2] [--plot docs/images/lag-study.png]
    python -m benchmarks.lag_study --out lag-study.jsonl --analyse   # the figures of the runs so far

Each run trains the tiny preset from random weights with the sampling weights `lag` optimizer
steps behind the learner's (what the pipeline's in-flight updates do), every other setting as
`pipelinerl run`'s. A run's reward per sample is the mean reward over all of its samples (the area
under its learning curve, so learning sooner counts); its step size is the mean KL between the
policy before and after each optimizer step on the samples that step trained.

Tasks: `copy` is `builtin:copy:2` (3-token completions), 16,384 samples a run; `repeat` is
`builtin:repeat:16`, the long-tail task at a length two cores can repeat hundreds of times (1 to
16 digits, most of them short), 8,192 samples a run. Losses: `default` (truncated importance
weights, `pipelinerl run`'s), `decoupled` (AReaL's decoupled PPO, `kind: decoupled`), `m2po`
(the same with M2PO's second-moment mask, `m2_threshold: 0.04`, as AReaL's M2PO example) and
`token_bound` (the default with `max_token_lag: 1`: tokens more than one version old leave the
loss); the corrections only run with lag, and every gap is measured against the default loss at lag 0 on the
same seeds (same initial weights, same prompts), so it is a paired difference.

`--in-flight` makes every lagged run's update arrive in flight (`single_process.py --in-flight`):
each completion's tokens past half of its budget are sampled by weights one step newer, so a long
completion holds tokens `lag` and `lag` − 1 versions old, as the pipeline's do; its lag is written
`2 → 1` in the table. Lag 0 runs are the same with or without it.

Each finished run is appended to --out as one JSON line and runs already there are skipped, so an
interrupted study resumes where it stopped; seeds are the outer loop, so a study cut short has
every point with fewer seeds. Ends with one JSON line: runs, and per point (task, loss, lr, lag)
its seeds, reward per sample and 95 % confidence interval, gap to lag 0 and its interval,
vs_default (a correction's reward per sample minus the default loss's at the same lr and lag,
paired by seed) and its interval, and step KL.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.single_process import parser as run_parser
from benchmarks.single_process import train
from pipelinerl.common.log import configure_logging

TASKS = {
    "copy": ["--dataset", "builtin:copy:2", "--max-new-tokens", "3", "--samples", "16384"],
    "repeat": ["--dataset", "builtin:repeat:16", "--max-new-tokens", "17", "--samples", "8192"],
}
LOSSES = {
    "default": {},
    "decoupled": {"loss": {"kind": "decoupled"}},
    "m2po": {"loss": {"kind": "decoupled", "m2_threshold": 0.04}},
    "token_bound": {"loss": {"max_token_lag": 1}},
}
BASELINE = "default"

# Student t, two-sided 95 %: the 0.975 quantile for 1 to 30 degrees of freedom.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)  # fmt: skip


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95 % confidence interval (None below two values)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, None
    t = _T975[len(values) - 2] if len(values) - 1 <= len(_T975) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def key(run: dict) -> tuple:
    """(task, loss, lr, lag, in flight, seed); the point a run belongs to is all but the seed."""
    return run["task"], run["loss"], run["lr"], run["lag"], run.get("in_flight", False), run["seed"]


def grid(args: argparse.Namespace) -> list[dict]:
    """Every run of the study, seeds outermost."""
    runs = []
    for seed in range(args.seeds):
        for task in args.tasks:
            for lr in args.lrs:
                for lag in args.lags:
                    for loss in args.losses:
                        if loss == BASELINE or lag > 0:
                            in_flight = args.in_flight and lag > 0
                            runs.append({"task": task, "loss": loss, "lr": lr, "lag": lag,
                                         "in_flight": in_flight, "seed": seed})  # fmt: skip
    return runs


def run_one(run: dict) -> dict:
    configure_logging("benchmark", level="warning")  # each worker is a fresh process
    argv = [*TASKS[run["task"]], "--lr", str(run["lr"]), "--lag", str(run["lag"]), "--seed", str(run["seed"])]
    argv += ["--learner", json.dumps(LOSSES[run["loss"]]), "--threads", "1", "--quiet"]
    argv += ["--in-flight"] if run["in_flight"] else []
    return {**run, **{k: v for k, v in train(run_parser().parse_args(argv)).items() if k not in run}}


def analyse(runs: list[dict]) -> list[dict]:
    by_point: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for run in runs:
        by_point[key(run)[:5]][run["seed"]] = run
    points = []
    for (task, loss, lr, lag, in_flight), seeds in sorted(by_point.items()):
        reward, reward_ci = mean_ci([r["reward_mean"] for r in seeds.values()])
        base = by_point.get((task, BASELINE, lr, 0, False), {})
        gap, gap_ci = _paired(seeds, base) if lag > 0 else (None, None)
        versus, versus_ci = (None, None)
        if loss != BASELINE:
            versus, versus_ci = _paired(seeds, by_point.get((task, BASELINE, lr, lag, in_flight), {}))
        kls = [r["step_kl"] for r in seeds.values() if r["step_kl"] is not None]
        points.append({
            "task": task, "loss": loss, "lr": lr, "lag": lag, "in_flight": in_flight, "seeds": len(seeds),
            "reward": round(reward, 4), "reward_ci": _round(reward_ci),
            "gap": _round(gap), "gap_ci": _round(gap_ci),
            "vs_default": _round(versus), "vs_default_ci": _round(versus_ci),
            "step_kl": float(f"{statistics.fmean(kls):.3g}") if kls else None,
        })  # fmt: skip
    return points


def _paired(seeds: dict[int, dict], base: dict[int, dict]) -> tuple[float | None, float | None]:
    """Mean and 95 % half-width of reward per sample minus `base`'s, over the seeds both ran."""
    differences = [seeds[s]["reward_mean"] - base[s]["reward_mean"] for s in seeds if s in base]
    return mean_ci(differences) if differences else (None, None)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def table(points: list[dict]) -> str:
    lines = [
        "| task | loss | lr | lag | seeds | reward per sample (95 % CI) | gap to lag 0 (95 % CI) "
        "| minus the default loss's at this lag (95 % CI) | step KL |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        reward = _signed(p["reward"], p["reward_ci"]).lstrip("+")
        gap, versus = _signed(p["gap"], p["gap_ci"]), _signed(p["vs_default"], p["vs_default_ci"])
        lag = f"{p['lag']} → {p['lag'] - 1}" if p["in_flight"] else p["lag"]
        cells = [p["task"], p["loss"], f"{p['lr']:g}", lag, p["seeds"], reward, gap, versus]
        lines.append("| " + " | ".join(map(str, cells)) + f" | {p['step_kl']:.2e} |")
    return "\n".join(lines)


def _signed(value: float | None, half_width: float | None) -> str:
    if value is None:
        return ""
    return f"{value:+.3f}" + (f" ± {half_width:.3f}" if half_width is not None else "")


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({p["task"] for p in points})
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5), squeeze=False)
    for axis, task in zip(axes[0], tasks, strict=True):
        for loss in LOSSES:
            for lag, marker in ((1, "o"), (2, "s")):
                shown = [
                    p
                    for p in points
                    if (p["task"], p["loss"], p["lag"]) == (task, loss, lag) and p["gap"] is not None
                ]
                if not shown:
                    continue
                style = "-" if loss == BASELINE else ":"
                axis.errorbar([p["step_kl"] for p in shown], [p["gap"] for p in shown],
                              yerr=[p["gap_ci"] or 0 for p in shown], marker=marker, capsize=3,
                              linestyle=style, label=f"{loss}, lag {lag}")  # fmt: skip
        axis.axhline(0, color="grey", linewidth=0.8)
        axis.set_xscale("log")
        axis.set_xlabel("per-step KL between consecutive versions (nats per token)")
        axis.set_ylabel("reward per sample, minus lag 0's (same seeds)")
        axis.set_title(task)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per finished run")
    parser.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS))
    parser.add_argument(
        "--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-4, 3e-4, 1e-3, 3e-3]
    )
    parser.add_argument("--lags", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--losses", type=lambda s: s.split(","), default=["default", "decoupled", "m2po"])
    parser.add_argument(
        "--in-flight",
        action="store_true",
        help="each lagged run's update arrives halfway through a completion",
    )
    parser.add_argument("--workers", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--analyse", action="store_true", help="only the figures of the runs in --out")
    args = parser.parse_args()
    for name in args.tasks + args.losses:
        if name not in TASKS and name not in LOSSES:
            parser.error(f"unknown task or loss {name!r}")

    done = [json.loads(line) for line in args.out.read_text().splitlines()] if args.out.exists() else []
    if not args.analyse:
        finished = {key(r) for r in done}
        todo = [r for r in grid(args) if key(r) not in finished]
        print(f"{len(done)} runs done, {len(todo)} to go", flush=True)
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool, args.out.open("a") as out:
            for result in pool.imap_unordered(run_one, todo):
                out.write(json.dumps(result) + "\n")
                out.flush()
                done.append(result)
                r = result
                lag = f"{r['lag']}{' in flight' if r['in_flight'] else ''}"
                print(f"{len(done)}: {r['task']} {r['loss']} lr {r['lr']:g} lag {lag} seed {r['seed']}: "
                      f"reward {r['reward_mean']:.3f}, step KL {r['step_kl']:.2e}", flush=True)  # fmt: skip
    points = analyse(done)
    print(table(points))
    if args.plot:
        plot(points, args.plot)
    print(json.dumps({"runs": len(done), "points": points}))


if __name__ == "__main__":
    main()
