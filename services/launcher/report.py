"""What a run leaves behind: `metrics.jsonl` (one line per progress update) and `plot.png`
(reward, exact correctness and lag; zero-variance groups and entropy, to show a collapse; over time
and over trained samples); and the plot of several runs' rewards side by side (`plot_runs`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipelinerl.coordinator.types import RunInfo


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


class MetricsLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.points: list[Point] = []

    def add(self, point: Point) -> None:
        self.points.append(point)
        with self.path.open("a") as f:
            f.write(json.dumps(point.__dict__) + "\n")

    def time_to_reward(self, target: float) -> float | None:
        """Seconds until the mean reward first reached `target` (None if it never did)."""
        return next((p.elapsed_s for p in self.points if p.reward >= target and p.trained > 0), None)


def read_points(path: Path) -> list[Point]:
    """The points of a run's `metrics.jsonl`."""
    points = [json.loads(line) for line in path.read_text().splitlines()]
    return [Point(**(p | {"server_versions": tuple(p["server_versions"])})) for p in points]


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


def plot(points: list[Point], path: Path, title: str) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharex="col")
    for column, x, label in ((0, [p.elapsed_s for p in points], "seconds"),
                             (1, [p.trained for p in points], "trained samples")):  # fmt: skip
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
