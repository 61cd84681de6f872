"""What a run leaves behind: `metrics.jsonl` (one line per progress update) and `plot.png`
(reward, exact correctness and lag, over time and over trained samples)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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

    @classmethod
    def of(cls, run: RunInfo, elapsed_s: float) -> Point:
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


def plot(points: list[Point], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, x, label in ((axes[0], [p.elapsed_s for p in points], "seconds"),
                         (axes[1], [p.trained for p in points], "trained samples")):  # fmt: skip
        ax.plot(x, [p.reward for p in points], label="mean reward")
        ax.plot(x, [p.correct for p in points], label="exactly correct")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
        lag = ax.twinx()
        lag.plot(x, [p.lag for p in points], color="tab:red", alpha=0.6, label="lag (versions)")
        lag.set_ylabel("lag (versions)")
        ax.legend(loc="upper left")
        lag.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
