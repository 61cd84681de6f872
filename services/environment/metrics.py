"""Prometheus metrics of the environment service (`pipelinerl_environment_*`, listed in
docs/observability.md).

Each answered step's time in the environment's code is observed as it ends (`step_answered`);
episodes held and the counters are the episode table's own, read at each scrape (`watch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import Metric

from pipelinerl.common.metrics import counters, gauges, register_snapshot
from pipelinerl.environment.types import EnvironmentStats

PREFIX = "pipelinerl_environment"
STEP_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EnvironmentMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._step_seconds = Histogram(
            f"{PREFIX}_step_seconds",
            "Time the environment's code took to answer each step (answered steps only).",
            buckets=STEP_BUCKETS_S,
            registry=registry,
        )
        self._registry = registry

    def step_answered(self, seconds: float) -> None:
        self._step_seconds.observe(seconds)

    def watch(self, stats: Callable[[], EnvironmentStats]) -> None:
        """Read the episode table's counts (in the event loop) at every scrape."""

        def snapshot() -> Iterator[Metric]:
            s = stats()
            yield from gauges(
                PREFIX,
                {
                    "episodes_active": "Episodes held now (running, or finished and not yet ended).",
                    "max_episodes": "Most episodes held at once.",
                },
                {"episodes_active": s.active_episodes, "max_episodes": s.max_episodes},
            )
            yield from counters(
                PREFIX,
                {
                    "episodes_started": "Episodes started.",
                    "steps": "Steps answered (a retried step counts once).",
                    "episodes_reaped": "Episodes ended after their lease passed with no call.",
                    "failures": "Calls whose environment code raised, ran past step_timeout_s or broke "
                    "the contract (INTERNAL); each ends its episode.",
                },
                {
                    "episodes_started": s.episodes_started,
                    "steps": s.steps,
                    "episodes_reaped": s.episodes_reaped,
                    "failures": s.failures,
                },
            )

        register_snapshot(self._registry, snapshot)
