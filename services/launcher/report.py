"""What a run leaves behind: `metrics.jsonl` (one line per progress update, and one per held-out
evaluation, `{"evaluation": {...}}`) and `plot.png` (reward, exact correctness, held-out pass@1 and
lag; zero-variance groups and entropy, to show a collapse; over time, trained samples and weight
versions); and the plot of several runs' rewards side by side (`plot_runs`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelinerl.coordinator.types import RunInfo
from pipelinerl.trainer.tracking import StepLogs


@dataclass(frozen=True)
class Point:
    elapsed_s: float
    trained: int
    reward: float
    correct: float
    lag: float
    samples_per_s: float
    trainer_version: int
    server_versions: tuple[int, ...]
    zero_variance: float
    entropy: float
    restarts: dict[str, int] = field(default_factory=dict)
    """Restarts of each service so far (services never restarted are left out)."""
    episodes: dict[str, float] | None = None
    """An environment run's `EpisodeStats`: turns, tool calls, truncations, forks, errors, latency."""

    @classmethod
    def of(cls, run: RunInfo, elapsed_s: float, restarts: Mapping[str, int] | None = None) -> Point:
        p = run.progress
        return cls(
            elapsed_s=round(elapsed_s, 3),
            trained=p.trained,
            reward=p.reward_mean,
            correct=p.correct_fraction,
            lag=p.lag_mean,
            samples_per_s=p.samples_per_s,
            trainer_version=p.trainer_version,
            server_versions=tuple(s.version for s in p.servers),
            zero_variance=p.zero_variance_fraction,
            entropy=p.entropy,
            restarts=dict(restarts or {}),
            episodes=dataclasses.asdict(p.episodes) if p.episodes else None,
        )


TRACKED = ("pass_at_1", "pass_at_k", "reward_mean", "completion_tokens_mean", "truncated_fraction")
"""The figures of each evaluation logged to TensorBoard and W&B."""


@dataclass(frozen=True)
class Evaluated:
    """A held-out evaluation as `metrics.jsonl` holds it: its result, and where the run was."""

    elapsed_s: float
    trained: int
    evaluation: dict[str, Any]
    """`EvaluationResult`'s fields; `finished_at` as ISO 8601."""


class MetricsLog:
    def __init__(self, path: Path, tracking: StepLogs | None = None) -> None:
        """`tracking`: where each evaluation's figures go too (TensorBoard, W&B), at its version."""
        self.path = path
        self.points: list[Point] = []
        self.evaluations: list[Evaluated] = []
        self._tracking = tracking

    def add(self, point: Point, run: RunInfo | None = None) -> None:
        """`point`, and the evaluations of `run` not written yet."""
        self.points.append(point)
        lines = [point.__dict__]
        for result in run.evaluations[len(self.evaluations) :] if run else ():
            self.evaluations.append(Evaluated(point.elapsed_s, point.trained, result.to_json()))
            lines.append(dataclasses.asdict(self.evaluations[-1]))
            if self._tracking is not None:
                values = {f"eval/{result.dataset}/{name}": getattr(result, name) for name in TRACKED}
                self._tracking.log(result.weight_version, values)
        with self.path.open("a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)

    def time_to_reward(self, target: float) -> float | None:
        """Seconds until the mean reward first reached `target` (None if it never did)."""
        return next((p.elapsed_s for p in self.points if p.reward >= target and p.trained > 0), None)


def read_points(path: Path) -> list[Point]:
    """The progress points of a run's `metrics.jsonl`."""
    points = [p for line in path.read_text().splitlines() if "evaluation" not in (p := json.loads(line))]
    return [Point(**(p | {"server_versions": tuple(p["server_versions"])})) for p in points]


def read_evaluations(path: Path) -> list[Evaluated]:
    """The held-out evaluations of a run's `metrics.jsonl`."""
    lines = (json.loads(line) for line in path.read_text().splitlines())
    return [Evaluated(**line) for line in lines if "evaluation" in line]


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: dict[str, list[Point]], path: Path, title: str) -> Path:
    """The mean reward of several runs of one task side by side, against wall time and against
    trained samples, from each run's first trained sample on."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, every in runs.items():
        points = [p for p in every if p.trained > 0]
        axes[0].plot([p.elapsed_s for p in points], [p.reward for p in points], label=name)
        axes[1].plot([p.trained for p in points], [p.reward for p in points], label=name)
    for ax, label in ((axes[0], "seconds"), (axes[1], "trained samples")):
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].set_ylabel("mean reward (last 256 samples)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot(points: list[Point], path: Path, title: str, evaluations: Sequence[Evaluated] = ()) -> Path:
    """The run's curves against seconds, trained samples and the trainer's version; each held-out
    set's pass@1 beside the training reward, at the weight version that generated it."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(18, 8), sharex="col")
    columns = (
        ("seconds", [p.elapsed_s for p in points], [e.elapsed_s for e in evaluations]),
        ("trained samples", [p.trained for p in points], [e.trained for e in evaluations]),
        ("weight version", [p.trainer_version for p in points],
         [e.evaluation["weight_version"] for e in evaluations]),
    )  # fmt: skip
    for column, (label, x, at) in enumerate(columns):
        _panel(
            axes[0][column],
            x,
            [
                ("mean reward", [p.reward for p in points], {}),
                ("exactly correct", [p.correct for p in points], {}),
            ],
            ("lag (versions)", [p.lag for p in points], {"color": "tab:red", "alpha": 0.6}),
            "lower right",
        )
        for name in dict.fromkeys(e.evaluation["dataset"] for e in evaluations):
            held = [(x, e.evaluation["pass_at_1"]) for x, e in zip(at, evaluations, strict=True)
                    if e.evaluation["dataset"] == name]  # fmt: skip
            axes[0][column].plot(*zip(*held, strict=True), "o-", markersize=3, linewidth=1,
                                 label=f"held-out pass@1 {name}")  # fmt: skip
        if evaluations:
            axes[0][column].legend(loc="center right")
        # A collapse shows here: most groups teach nothing while the entropy falls to ~0.
        _panel(axes[1][column], x,
               [("zero-variance groups", [p.zero_variance for p in points], {"color": "tab:purple"})],
               ("entropy (nats/token)", [p.entropy for p in points], {"color": "tab:green", "alpha": 0.7}),
               "upper right")  # fmt: skip
        axes[1][column].set_xlabel(label)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


Line = tuple[str, Sequence[float], dict[str, Any]]
"""A series of a plot: its label, its values and its matplotlib style."""


def _panel(ax: Any, x: Sequence[float], fractions: list[Line], twin: Line, twin_legend: str) -> None:
    """`fractions` (values in [0, 1]) on `ax`, and `twin` on a second y axis of its own."""
    for name, values, style in fractions:
        ax.plot(x, values, label=name, **style)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    name, values, style = twin
    other = ax.twinx()
    other.plot(x, values, label=name, **style)
    other.set_ylabel(name)
    ax.legend(loc="upper left")
    other.legend(loc=twin_legend)
