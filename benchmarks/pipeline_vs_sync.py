"""Pipeline (in-flight updates) against the conventional sync baseline, on the same services.

Both runs use the same task, seed, model, learning rate, group size, samples per optimizer step
and sample budget; only the overlap differs. Fairness on CPU: pipeline mode pins inference and
trainer to separate cores with one thread each; sync mode gives each phase every core (its phases
never run at once). The launcher does this placement; see `pipelinerl.launcher.run`.

    python benchmarks/pipeline_vs_sync.py [--samples 40960] [--target 0.6] [--lr 3e-4]
                                          [--dataset builtin:copy:2] [--model tiny]
                                          [--max-new-tokens N] [--conventional-steps 0]
                                          [--max-in-flight 256]
                                          [--environment guess_number] [--environment-args JSON]
                                          [--step-latency 0.01,1.0]

`--dataset builtin:repeat` is the long-tail task (completion lengths from 2 to 129 tokens, a round's
p99 about 14 times its median); `--max-new-tokens` defaults to what the dataset needs. `--conventional-steps
K` (K > 1) adds a third run, the conventional variant the PipelineRL paper compares against: sync
mode with rounds of K × samples-per-step, each generated with one version and then trained by K
steps, so its later steps train on samples up to K - 1 versions old (same cores, seed and budget).
`--max-in-flight` sets the pipeline run's window (`pipelinerl run`'s default, two steps, unless
given): fewer attempts in flight make its samples younger and leave its trainer waiting longer.

`--environment NAME` compares the runs on a multi-turn task instead of `--dataset`: every attempt is
an episode of that environment (`pipelinerl run --environment`), with `--environment-args` for its
class. `--step-latency LOW,HIGH` makes every step of it wait a time drawn log-uniformly between LOW
and HIGH seconds (`benchmarks/slow_environment.py`), as real tools do; the wait is not CPU, so the
pipeline can fill it with generation and training while the sync baseline cannot. The figures then
add `environment`, `step_latency_s`, and per run `turns_mean_<run>`, `step_seconds_mean_<run>`,
`episodes_in_flight_<run>` (the mean over the run of the episodes its environment replicas held,
sampled every second from `pipelinerl_environment_episodes_active`),
`server_prefill_tokens_per_episode_<run>` (the prompt tokens its inference servers ran through the
model over the episodes played: a group's shared opening counts once, and a turn that took the
cache kept from the episode's last turn counts only what it added; the coordinator's
`prefill_tokens_mean`, what the turns asked for, is a mean over the last 256 episodes, not
comparable) and `reused_prompt_share_<run>`
(prompt tokens taken from kept caches over all prompt tokens the servers had, from
`pipelinerl_inference_prefill_tokens_total` and `pipelinerl_inference_reused_prompt_tokens_total`).

Each invocation starts both runs fresh in a folder of its own (`--out`, by default a new
timestamped folder under runs/pipeline_vs_sync/): a folder that already holds a run is refused,
since the launcher would resume that run from its journal and measure nothing. A run that did not
complete its budget from scratch is an error (exit 1), never a line of figures.

Ends with one JSON line: pipeline_samples_per_s, sync_samples_per_s, throughput_ratio,
pipeline_time_to_reward_s, sync_time_to_reward_s, time_to_reward_ratio, final_reward_pipeline,
final_reward_sync, mean_lag, ess; plus the target, the pipeline's max_in_flight,
sustained_time_to_reward_ratio (crossings of the mean over the last 4,096 samples),
final_reward_*_last_8192 (mean over the last 8,192 samples), throughput_ceiling (sync wall time ×
cores / the pipeline's CPU seconds: the most overlap can gain on this machine), per-phase trainer
timings and CPU seconds per service; and, from each run's journal and its inference server's
counters:

- `length_p50`, `length_p90`, `length_p99`, `length_max`, `length_mean`, `length_p99_over_p50`:
  completion lengths in tokens (end-of-sequence included) of every attempt the pipeline run
  generated; `sync_length_mean`, `sync_length_p99_over_p50` the same of the sync run, and
  `sync_round_length_p99_over_p50` the median over the sync run's rounds of each round's ratio;
  `length_p99_over_p50_by_quarter` and `sync_round_length_p99_over_p50_by_quarter` the same over
  each quarter of the run's attempts (a policy learns the lengths as it goes).
- `occupancy_pipeline`, `occupancy_sync` (`occupancy_conventional`): mean running sequences per
  decode step of the run's inference server, out of `max_running_<mode>` (the launcher's window
  for the run: its attempts in flight, a whole round in sync mode); `occupancy_*_by_quarter` the
  same over each quarter of its decode steps. Sampled every second from the server's
  `pipelinerl_inference_decode_steps_total` and `pipelinerl_inference_decoded_rows_total`
  counters (the series is in `<run>/occupancy.jsonl`), so the mean is exact per decode step.
- `mean_reward_*`: the mean reward of every scored attempt of the run: reward per sample over the
  same budget.
- `pipeline_token_lag`: the mean lag over every trained completion token, from the trainer's lag
  histograms (`mean_lag` is the mean of the coordinator's 256-sample moving average).
- with `--conventional-steps`: `conventional_samples_per_s`, `conventional_time_to_reward_s`,
  `final_reward_conventional(_last_8192)`, `conventional_mean_lag` (per trained token, as
  `pipeline_token_lag`; (K - 1) / 2 by construction), `conventional_round_steps`.
- `plot`: `<out>/reward.png`, every run's mean reward against wall time and trained samples.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import sqlite3
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import yaml

from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.report import Point, plot_runs, read_points
from pipelinerl.launcher.run import RunResult, launch

log = get_logger("benchmark")
SLOW_ENVIRONMENT = Path(__file__).resolve().parent / "slow_environment.py"

SUSTAIN_SAMPLES = 4096
FINAL_SAMPLES = 8192


class NoFigures(Exception):
    """A run that cannot be measured: it resumed, failed, or trained nothing."""


def fresh_folder(out: Path) -> Path:
    """`out`, which must not hold anything yet: a run folder is resumed, not restarted."""
    if out.exists() and any(out.iterdir()):
        raise NoFigures(f"{out} holds an earlier run, which would resume from its journal; pass a new --out")
    return out


def check_run(result: RunResult, points: list[Point], samples: int) -> None:
    """A completed run of `samples` attempts, measured from its start: progress points from the
    first trained samples on, and wall time for each of them."""
    if result.state != "completed":
        raise NoFigures(f"the {result.mode} run ended {result.state}, not completed")
    if result.trained <= 0 or len(points) < 2 or points[0].trained >= samples:
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


def token_lag(run_dir: Path) -> float:
    """Mean lag (trainer version at the step minus the version that generated the token) over every
    completion token trained, from the trainer's per-step lag histograms."""
    steps = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    counts = [(int(lag), n) for step in steps for lag, n in step["lag_histogram"].items()]
    return round(sum(lag * n for lag, n in counts) / max(sum(n for _, n in counts), 1), 2)


def cpu_seconds(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "cpu_seconds.json").read_text())


RunName = Literal["pipeline", "sync", "conventional"]


def run_settings(name: RunName, args: argparse.Namespace) -> RunSettings:
    """The settings of one run: the same for every run but the mode, the conventional variant's
    round and the pipeline's `max_in_flight`."""
    pipeline = name == "pipeline"
    environment: dict[str, object] = {}
    if args.environment is not None:
        environment = {"environment": args.environment, "environment_args": args.environment_args}
        if args.step_latency is not None:  # the same environment behind a log-uniform wait per step
            inner = RunSettings(environment=args.environment).environment_class
            environment = {
                "environment": f"{SLOW_ENVIRONMENT}:Slow",
                "environment_args": {
                    "env": inner, "env_args": args.environment_args, "latency_s": list(args.step_latency),
                },
            }  # fmt: skip
    return RunSettings(
        mode="pipeline" if pipeline else "sync",
        round_steps=args.conventional_steps if name == "conventional" else 1,
        run_dir=Path(args.out) / name,
        dataset=args.dataset,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        lr=args.lr,
        max_samples=args.samples,
        duration_s=args.max_seconds,
        target_reward=None,
        eval=[],  # held-out evaluation costs both modes alike; benchmarks/eval_cost.py measures it
        **environment,
        # sync mode has no window of its own: a round is what it generates at once
        **({"max_in_flight": args.max_in_flight} if pipeline else {}),
    )


def run(name: RunName, args: argparse.Namespace) -> tuple[RunResult, dict[str, float]]:
    settings = run_settings(name, args)
    run_dir = settings.run_dir
    log.info("running", run=name, samples=args.samples)
    sampler = OccupancySampler(run_dir)
    sampler.start()
    try:
        result = asyncio.run(launch(settings))
    finally:
        sampler.stop()
    log.info("done", run=name, seconds=round(result.elapsed_s, 1), reward=round(result.final_reward, 3))
    check_run(result, progress_points(result), args.samples)
    return result, trainer_means(run_dir)


# ---- completion lengths and batch occupancy ---------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of sorted values: the smallest value with at least q % at or below it."""
    rank = max(int(-(-q * len(ordered) // 100)), 1)  # ceil(q/100 × n), at least the first
    return ordered[rank - 1]


def length_figures(lengths: Sequence[int]) -> dict[str, float]:
    """Median, p90, p99, max, mean and p99/median of completion lengths."""
    ordered = sorted(lengths)
    p50, p99 = percentile(ordered, 50), percentile(ordered, 99)
    return {
        "p50": p50,
        "p90": percentile(ordered, 90),
        "p99": p99,
        "max": ordered[-1],
        "mean": round(statistics.fmean(ordered), 2),
        "p99_over_p50": round(p99 / p50, 2),
    }


def quarters(values: Sequence[int]) -> list[Sequence[int]]:
    """`values` cut into four consecutive quarters."""
    return [values[len(values) * q // 4 : len(values) * (q + 1) // 4] for q in range(4)]


def round_spread(lengths: Sequence[int], round_size: int) -> float | None:
    """Median over consecutive rounds of `round_size` completions of each round's p99/median (None:
    not one whole round)."""
    rounds = [lengths[i : i + round_size] for i in range(0, len(lengths) - round_size + 1, round_size)]
    return round(statistics.median(length_figures(r)["p99_over_p50"] for r in rounds), 2) if rounds else None


def journal_attempts(run_dir: Path) -> list[tuple[int, float | None]]:
    """(completion tokens, reward) of every generated attempt of the run, in prompt order."""
    db = sqlite3.connect(f"file:{run_dir / 'journal.sqlite'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "SELECT a.completion, a.reward FROM attempts a JOIN groups g USING (group_id)"
            " WHERE a.completion IS NOT NULL ORDER BY g.prompt_index, a.sample_id"
        ).fetchall()
    finally:
        db.close()
    return [(len(json.loads(completion)["token_ids"]), reward) for completion, reward in rows]


def occupancy_figures(samples: Sequence[tuple[float, int, int]]) -> dict[str, float | list[float | None]]:
    """From (seconds, decode steps, decoded rows) counter readings: the mean running sequences per
    decode step over the whole run, and over each quarter of its time (None: no step in it)."""
    steps = samples[-1][1] - samples[0][1]
    if steps <= 0:
        return {"mean": 0.0, "by_quarter": []}
    t0, span = samples[0][0], samples[-1][0] - samples[0][0]
    sums = [[0, 0] for _ in range(4)]  # [steps, rows] of each quarter
    for (ta, sa, ra), (tb, sb, rb) in itertools.pairwise(samples):
        quarter = min(int(4 * ((ta + tb) / 2 - t0) / span), 3) if span > 0 else 0
        sums[quarter][0] += sb - sa
        sums[quarter][1] += rb - ra
    quarters = [round(rows / n, 1) if n else None for n, rows in sums]
    return {"mean": round((samples[-1][2] - samples[0][2]) / steps, 2), "by_quarter": quarters}


COUNTERS = ("decode_steps", "decoded_rows", "prefill_tokens", "reused_prompt_tokens")
_COUNTER = re.compile(rf"^pipelinerl_inference_({'|'.join(COUNTERS)})_total(?:\{{[^}}]*\}})? (\S+)$", re.M)


def read_counters(text: str) -> dict[str, int] | None:
    """The built-in engine's `COUNTERS` summed over a /metrics exposition (0 for one it lacks),
    None if it has none of them."""
    found = dict.fromkeys(COUNTERS, 0.0)
    matches = _COUNTER.findall(text)
    for name, value in matches:
        found[name] += float(value)
    return {name: int(value) for name, value in found.items()} if matches else None


class OccupancySampler(threading.Thread):
    """Reads the run's inference servers' decode counters once a second (their addresses come from
    `<run>/prometheus_targets.json` once the services are up) and writes `<run>/occupancy.jsonl`.
    A scrape costs the server one snapshot of its engine's counters; the thread sleeps between."""

    def __init__(self, run_dir: Path, every_s: float = 1.0) -> None:
        super().__init__(name="occupancy", daemon=True)
        self.run_dir = run_dir
        self.every_s = every_s
        self.samples: list[tuple[float, int, int]] = []
        self.prompts: list[tuple[int, int]] = []
        """Prompt tokens the servers prefilled and took from kept caches, at each sample."""
        self.episodes: list[int] = []
        """Episodes the run's environment replicas held, at each sample (none without one)."""
        self._stopped = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        targets: list[str] = []
        environments: list[str] = []
        while not self._stopped.wait(self.every_s):
            if not targets:
                targets, environments = self._targets("inference"), self._targets("environment")
                continue
            try:
                texts = [_scrape(target) for target in targets]
                held = [_episodes_active(_scrape(target)) for target in environments]
            except OSError:  # the run is stopping: keep what was read
                continue
            counters = read_counters("\n".join(texts))
            if counters is not None:
                self.samples.append(
                    (round(time.monotonic() - started, 2), counters["decode_steps"], counters["decoded_rows"])
                )
                self.prompts.append((counters["prefill_tokens"], counters["reused_prompt_tokens"]))
                if environments:
                    self.episodes.append(sum(held))

    def _targets(self, job: str) -> list[str]:
        path = self.run_dir / "prometheus_targets.json"
        if not path.is_file():
            return []
        entries = json.loads(path.read_text())
        return [t for e in entries if e["labels"]["job"] == job for t in e["targets"]]

    def stop(self) -> None:
        self._stopped.set()
        self.join()
        if self.run_dir.is_dir():
            keys = ("elapsed_s", "decode_steps", "decoded_rows")
            rows: list[dict[str, float]] = [dict(zip(keys, s, strict=True)) for s in self.samples]
            for row, (prefilled, reused) in zip(rows, self.prompts, strict=True):
                row["prefill_tokens"], row["reused_prompt_tokens"] = prefilled, reused
            for row, held in zip(rows, self.episodes, strict=False):
                row["episodes_active"] = held
            (self.run_dir / "occupancy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _scrape(target: str) -> str:
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=2) as response:
        return response.read().decode()


_EPISODES_ACTIVE = re.compile(r"^pipelinerl_environment_episodes_active(?:\{[^}]*\})? (\S+)$", re.M)


def _episodes_active(text: str) -> int:
    return sum(int(float(v)) for v in _EPISODES_ACTIVE.findall(text))


def progress_points(result: RunResult) -> list[Point]:
    """The run's metrics.jsonl: one progress point per second (elapsed_s, trained, reward, ...)."""
    return read_points(result.metrics_path)


def time_to(result: RunResult, target: float) -> float | None:
    """First time the reward (the coordinator's moving mean of the last 256 samples) reaches `target`."""
    points = progress_points(result)
    return next((p.elapsed_s for p in points if p.trained > 0 and p.reward >= target), None)


def time_to_sustained(result: RunResult, target: float, span: int = SUSTAIN_SAMPLES) -> float | None:
    """First time the mean of the reward points over the last `span` trained samples reaches
    `target`: less sensitive to one lucky window than `time_to`."""
    points = progress_points(result)
    for i, point in enumerate(points):
        window = [p.reward for p in points[: i + 1] if p.trained > point.trained - span]
        if point.trained >= span and statistics.fmean(window) >= target:
            return point.elapsed_s
    return None


def final_mean(result: RunResult, span: int = FINAL_SAMPLES) -> float:
    """Mean of the reward points over the last `span` trained samples (steadier than the last point)."""
    points = progress_points(result)
    last = points[-1].trained
    return statistics.fmean(p.reward for p in points if p.trained > max(last - span, 0))


def throughput_ceiling(out: Path, sync_seconds: float) -> float:
    """The most the pipeline could gain with every core busy: sync wall time × cores over the CPU
    seconds the pipeline needed for the same samples."""
    return sync_seconds * len(os.sched_getaffinity(0)) / sum(cpu_seconds(out / "pipeline").values())


def long_tail_figures(out: Path, args: argparse.Namespace, conventional: bool) -> dict[str, object]:
    """Completion lengths, batch occupancy and reward per sample of each run (see the docstring)."""
    runs = ["pipeline", "sync", *(["conventional"] if conventional else [])]
    attempts = {name: journal_attempts(out / name) for name in runs}
    lengths = {name: [n for n, _ in rows] for name, rows in attempts.items()}
    pipeline, sync = length_figures(lengths["pipeline"]), length_figures(lengths["sync"])
    round_size = RunSettings.model_fields["samples_per_step"].default
    figures: dict[str, object] = {f"length_{key}": value for key, value in pipeline.items()}
    figures |= {
        "sync_length_mean": sync["mean"],
        "sync_length_p99_over_p50": sync["p99_over_p50"],
        "sync_round_length_p99_over_p50": round_spread(lengths["sync"], round_size),
        # a policy learns the lengths as it goes: the tail shows in the later quarters
        "length_p99_over_p50_by_quarter": [
            length_figures(q)["p99_over_p50"] for q in quarters(lengths["pipeline"])
        ],
        "sync_round_length_p99_over_p50_by_quarter": [
            round_spread(q, round_size) for q in quarters(lengths["sync"])
        ],
    }
    for name in runs:
        # the window the launcher gave the run's server (it always writes one): its share of the
        # attempts in flight
        config = yaml.safe_load((out / name / "inference-0.yaml").read_text())
        figures[f"max_running_{name}"] = config["max_running"]
        occupancy = occupancy_figures(read_occupancy(out / name))
        figures[f"occupancy_{name}"] = occupancy["mean"]
        figures[f"occupancy_{name}_by_quarter"] = occupancy["by_quarter"]
        rewards = [r for _, r in attempts[name] if r is not None]
        figures[f"mean_reward_{name}"] = round(statistics.fmean(rewards), 3) if rewards else None
    return figures


def episode_figures(out: Path, runs: dict[str, RunResult]) -> dict[str, object]:
    """Turns, step latency and episodes in flight of each run of an environment comparison."""
    figures: dict[str, object] = {}
    for name, result in runs.items():
        last = next((p.episodes for p in reversed(progress_points(result)) if p.episodes), None) or {}
        figures[f"turns_mean_{name}"] = round(last.get("turns_mean", 0.0), 2)
        figures[f"step_seconds_mean_{name}"] = round(last.get("step_seconds_mean", 0.0), 3)
        path = out / name / "occupancy.jsonl"
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        held = [line["episodes_active"] for line in lines if "episodes_active" in line]
        figures[f"episodes_in_flight_{name}"] = round(statistics.fmean(held), 1) if held else None
        prompts = next((line for line in reversed(lines) if "prefill_tokens" in line), None)
        if prompts and last.get("episodes"):
            prefilled, reused = prompts["prefill_tokens"], prompts["reused_prompt_tokens"]
            figures[f"server_prefill_tokens_per_episode_{name}"] = round(prefilled / last["episodes"], 1)
            figures[f"reused_prompt_share_{name}"] = (
                round(reused / (prefilled + reused), 3) if prefilled else None
            )
    return figures


def read_occupancy(run_dir: Path) -> list[tuple[float, int, int]]:
    path = run_dir / "occupancy.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    samples = [(line["elapsed_s"], line["decode_steps"], line["decoded_rows"]) for line in lines]
    return samples or [(0.0, 0, 0)]


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--samples", type=int, default=40960, help="trained samples per run")
    parser.add_argument("--target", type=float, default=0.6, help="reward for time-to-reward")
    parser.add_argument("--dataset", default="builtin:copy:2")
    parser.add_argument("--model", default=RunSettings.model_fields["model"].default)
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="default: what the dataset needs (its longest answer)",
    )
    parser.add_argument(
        "--conventional-steps",
        type=int,
        default=0,
        help="K > 1 adds the conventional run (K steps per round)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=RunSettings.model_fields["lr"].default)
    parser.add_argument(
        "--max-in-flight",
        type=int,
        default=RunSettings.model_fields["max_in_flight"].default,
        help="the pipeline run's attempts in flight (how far generation runs ahead of training)",
    )
    parser.add_argument("--environment", default=None, help="a multi-turn task instead of --dataset")
    parser.add_argument("--environment-args", type=json.loads, default={}, help="JSON: the class's arguments")
    parser.add_argument(
        "--step-latency",
        type=lambda text: tuple(float(x) for x in text.split(",")),
        default=None,
        help="LOW,HIGH seconds: each environment step waits log-uniformly between them",
    )
    parser.add_argument("--max-seconds", type=float, default=900.0, help="cap on each run")
    parser.add_argument("--out", default=None, help="a new folder (default: runs/pipeline_vs_sync/<time>)")
    args = parser.parse_args()
    if args.conventional_steps == 1 or args.conventional_steps < 0:
        parser.error("--conventional-steps must be 0 (no conventional run) or at least 2")
    args.out = args.out or f"runs/pipeline_vs_sync/{time.strftime('%Y%m%d-%H%M%S')}"
    configure_logging("benchmark", "console", "info")
    try:
        fresh_folder(Path(args.out))
        pipeline, pipeline_trainer = run("pipeline", args)
        sync, sync_trainer = run("sync", args)
        conventional = run("conventional", args)[0] if args.conventional_steps else None
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
        "pipeline_token_lag": token_lag(Path(args.out) / "pipeline"),
        "ess": round(pipeline_trainer["ess"], 3),
        "sync_ess": round(sync_trainer["ess"], 3),
        "samples": args.samples,
        "lr": args.lr,
        "max_in_flight": args.max_in_flight,
        "dataset": args.dataset if args.environment is None else "",
        "environment": args.environment,
        "step_latency_s": list(args.step_latency) if args.step_latency else None,
        "model": args.model,
        "max_new_tokens": RunSettings(
            dataset=args.dataset, environment=args.environment, max_new_tokens=args.max_new_tokens
        ).completion_tokens,
        "pipeline_trainer_step_s": round(pipeline_trainer["step_s"], 4),
        "sync_trainer_step_s": round(sync_trainer["step_s"], 4),
        "pipeline_trainer_wait_s": round(pipeline_trainer["wait_s"], 4),
        "sync_trainer_wait_s": round(sync_trainer["wait_s"], 4),
        "pipeline_seconds": round(pipeline.elapsed_s, 1),
        "sync_seconds": round(sync.elapsed_s, 1),
        # Where the CPU went: seconds of CPU per service over each run (two cores available).
        "pipeline_cpu_s": cpu_seconds(Path(args.out) / "pipeline"),
        "sync_cpu_s": cpu_seconds(Path(args.out) / "sync"),
        **long_tail_figures(Path(args.out), args, conventional is not None),
    }
    if conventional is not None:
        figures |= {
            "conventional_round_steps": args.conventional_steps,
            "conventional_samples_per_s": round(conventional.samples_per_s, 1),
            "conventional_time_to_reward_s": time_to(conventional, args.target),
            "final_reward_conventional": round(conventional.final_reward, 3),
            "final_reward_conventional_last_8192": round(final_mean(conventional), 3),
            "conventional_mean_lag": token_lag(Path(args.out) / "conventional"),
            "conventional_seconds": round(conventional.elapsed_s, 1),
        }
    if args.environment is not None:
        finished = {"pipeline": pipeline, "sync": sync} | (
            {"conventional": conventional} if conventional else {}
        )
        figures |= episode_figures(Path(args.out), finished)
    runs = {name: progress_points(result) for name, result in
            (("pipeline", pipeline), ("sync", sync), ("conventional", conventional)) if result}  # fmt: skip
    task = args.environment or args.dataset
    figures["plot"] = str(plot_runs(runs, Path(args.out) / "reward.png", f"{task}, lr {args.lr}"))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
