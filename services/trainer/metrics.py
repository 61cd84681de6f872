"""Prometheus metrics of the trainer (`pipelinerl_trainer_*`, listed in docs/observability.md).

Acks and steps are counted where they happen (`acked`, `stepped`); the version, the buffer and
the weight watchers are read from `Trainer.status()` at each scrape (`watch`).
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from pipelinerl.common.metrics import gauges, register_snapshot
from pipelinerl.trainer.learner import StepMetrics
from pipelinerl.trainer.types import Disposition, TrainerStatus

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
"""Upper bounds, in versions, of the token-lag histogram's buckets."""
PHASE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

PREFIX = "pipelinerl_trainer"
GAUGES = {
    "version": "Weight version (optimizer steps) the trainer has published.",
    "durable_version": "Newest version a checkpoint holds.",
    "buffered_samples": "Samples admitted and waiting for a step.",
    "buffer_fill_ratio": "Buffered samples over the buffer's capacity (max_buffered_samples).",
    "weight_watchers": "Inference servers following the weight versions.",
}
LAST_STEP = {
    "reward_mean": "Mean reward of the last step's samples.",
    "ess_ratio": "Effective sample size of the last step's importance weights, as a fraction.",
    "clipped_tokens_ratio": "Fraction of the last step's tokens whose ratio was clipped.",
    "entropy_nats": "Mean entropy of the policy over the last step's tokens.",
    "kl_nats": "Mean k3 KL to the reference model over the last step (0 without one).",
    "loss": "Loss of the last step.",
    "grad_norm": "Global gradient norm of the last step, before clipping.",
    "tokens_per_second": "Training throughput of the last step.",
}


def _last_step(step: StepMetrics) -> dict[str, float]:
    return {
        "reward_mean": step.reward_mean,
        "ess_ratio": step.ess,
        "clipped_tokens_ratio": step.clip_fraction,
        "entropy_nats": step.entropy or 0.0,
        "kl_nats": step.kl or 0.0,
        "loss": step.loss,
        "grad_norm": step.grad_norm,
        "tokens_per_second": step.tokens_per_s,
    }


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._acks = Counter(
            f"{PREFIX}_samples",
            "Sample acks sent, by disposition: accepted, trained, dropped (lag), duplicate, rejected.",
            ["disposition"],
            registry=registry,
        )
        # One child per disposition, bound once: `labels()` on every ack costs more than the count.
        self._acks_by = {disposition: self._acks.labels(disposition.value) for disposition in Disposition}
        self._phases = Histogram(
            f"{PREFIX}_step_phase_seconds",
            "Time of each phase of an optimizer step: wait (for its samples), prepare, "
            "forward_backward, optimizer, publish (of the new version), total.",
            ["phase"],
            buckets=PHASE_BUCKETS_S,
            registry=registry,
        )
        self._steps = Counter(f"{PREFIX}_steps", "Optimizer steps taken.", registry=registry)
        self._tokens = Counter(
            f"{PREFIX}_tokens", "Tokens trained on (prompt and completion).", registry=registry
        )
        self._last = {
            name: Gauge(f"{PREFIX}_{name}", doc, registry=registry) for name, doc in LAST_STEP.items()
        }
        self._lags: Tally[int] = Tally()
        """Trained completion tokens per lag (versions between the token's weights and the step's)."""

    def acked(self, disposition: Disposition) -> None:
        self._acks_by[disposition].inc()

    def stepped(self, step: StepMetrics, wait_s: float, publish_s: float, step_s: float) -> None:
        phases = {
            "wait": wait_s,
            "prepare": step.prepare_s,
            "forward_backward": step.forward_backward_s,
            "optimizer": step.optimizer_s,
            "publish": publish_s,
            "total": step_s,
        }
        for phase, seconds in phases.items():
            self._phases.labels(phase).observe(seconds)
        if not step.stepped:
            return
        self._steps.inc()
        self._tokens.inc(step.tokens)
        self._lags.update(step.lag_histogram)
        for name, value in _last_step(step).items():
            self._last[name].set(value)

    def watch(self, status: Callable[[], TrainerStatus], capacity: int) -> None:
        """Read `status()` (in the event loop) at every scrape; `capacity`: the most samples the
        buffer holds."""

        def snapshot() -> Iterator[Metric]:
            s = status()
            yield from gauges(
                PREFIX,
                GAUGES,
                {
                    "version": s.version.version,
                    "durable_version": s.durable_version,
                    "buffered_samples": s.buffered_samples,
                    "buffer_fill_ratio": s.buffered_samples / capacity,
                    "weight_watchers": s.watchers,
                },
            )
            yield self._lag_histogram()

        register_snapshot(self._registry, snapshot)

    def _lag_histogram(self) -> HistogramMetricFamily:
        cumulative = [sum(n for lag, n in self._lags.items() if lag <= bound) for bound in LAG_BUCKETS]
        return HistogramMetricFamily(
            f"{PREFIX}_token_lag_versions",
            "Lag of each trained completion token: versions between the weights that generated it "
            "and those it was trained on.",
            buckets=[*zip(map(str, LAG_BUCKETS), cumulative, strict=True), ("+Inf", self._lags.total())],
            sum_value=sum(lag * n for lag, n in self._lags.items()),
        )
