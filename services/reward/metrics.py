"""Prometheus metrics of the reward service (`pipelinerl_reward_*`, listed in docs/observability.md).

Each item's scoring time is observed as it ends (`item_scored`); items by outcome and worker
restarts are the scorer's own counts, read at each scrape (`watch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from pipelinerl.common.metrics import counters, gauges, register_snapshot
from pipelinerl.reward.types import ScorerStats

PREFIX = "pipelinerl_reward"
ITEM_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RewardMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._item_seconds = Histogram(
            f"{PREFIX}_item_seconds",
            "Time a worker took on each item (the verifiers, or the timeout when it ran past it).",
            buckets=ITEM_BUCKETS_S,
            registry=registry,
        )

    def item_scored(self, seconds: float) -> None:
        self._item_seconds.observe(seconds)

    def watch(self, stats: Callable[[], ScorerStats]) -> None:
        """Read the scorer's counts (in the event loop) at every scrape."""

        def snapshot() -> Iterator[Metric]:
            s = stats()
            items = CounterMetricFamily(
                f"{PREFIX}_items",
                "Items answered, by status: scored, invalid, timed_out, failed.",
                labels=["status"],
            )
            for status, count in (("scored", s.scored), ("invalid", s.invalid), ("timed_out", s.timed_out),
                                  ("failed", s.failed)):  # fmt: skip
                items.add_metric([status], count)
            yield items
            docs = {"worker_restarts": "Worker processes replaced after a timeout or a crash."}
            yield from counters(PREFIX, docs, {"worker_restarts": s.worker_restarts})
            yield from gauges(PREFIX, {"workers": "Verifier worker processes."}, {"workers": s.workers})

        register_snapshot(self._registry, snapshot)
