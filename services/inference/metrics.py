"""Prometheus metrics of an inference server (`pipelinerl_inference_*`, listed in
docs/observability.md), whichever engine serves it.

Finished sequences are counted as the servicer answers them (`finished`), the receive time of
each weight version as the engine takes it (`received`) and the stall of each swap as it happens
(`swapped`: a version that waits behind pinned requests is swapped in later); the batch,
throughput, version, pinned waits and the receiver's counters are read at each scrape (`watch`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from pipelinerl.common.metrics import counters, gauges, register_snapshot
from pipelinerl.common.types import FinishReason
from pipelinerl.inference.types import InferenceBackend

if TYPE_CHECKING:  # the receiver imports torch; the servicer, which counts sequences, must not
    from pipelinerl.weights.receiver import ReceiverStats

PREFIX = "pipelinerl_inference"
STALL_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
RECEIVE_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

GAUGES = {
    "running_sequences": "Sequences in the decode batch.",
    "queued_sequences": "Requests waiting for a place in the batch.",
    "tokens_per_second": "Tokens generated per second over the recent decode steps.",
    "weight_version": "Weight version served (-1 until the trainer's first has landed).",
}
KEPT_GAUGES = {
    "kept_caches": "KV caches kept for their episode's next turn (prompt_cache_key); built-in engine only."
}
COUNTERS = {
    "weight_updates": "Weight versions received, checked and swapped in (or staged behind pinned requests).",
    "weight_update_failures": "Versions that could not be had (the old weights were kept).",
    "weight_verification_failures": "Received buckets or chunks that failed their checksum.",
    "weight_fetch_fallbacks": "Versions fetched after their broadcast or CUDA IPC hand-off failed.",
    "weight_abandoned_broadcasts": "Broadcasts given up once the trainer had moved on to another group.",
}
PINNED_COUNTERS = {
    "weight_pinned_waits": "Weight versions that waited, staged, behind requests pinned to the one served.",
    "weight_pinned_wait_seconds": "Seconds versions waited behind pinned requests, the current wait too.",
}
BATCH_COUNTERS = {
    "decode_steps": "Decode steps (one forward over the running batch each); built-in engine only.",
    "decoded_rows": "Running sequences summed over the decode steps (over decode_steps: the mean occupancy).",
    "prefill_tokens": "Prompt tokens run through the model (a prompt shared by a group once).",
    "reused_prompt_tokens": "Prompt tokens taken from KV caches kept between turns instead of prefilled.",
}


class InferenceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry
        self._stall = Histogram(
            f"{PREFIX}_update_stall_seconds",
            "How long each weight update held up the running sequences (the swap between two decode steps).",
            buckets=STALL_BUCKETS_S,
            registry=registry,
        )
        self._sequences = Counter(
            f"{PREFIX}_sequences",
            "Sequences generated to the end, by finish reason (stop, length, abort).",
            ["finish_reason"],
            registry=registry,
        )
        self._sequences_by = {reason: self._sequences.labels(reason.value) for reason in FinishReason}
        self._tokens = Counter(
            f"{PREFIX}_generated_tokens", "Tokens of the finished sequences.", registry=registry
        )
        self._receive = Histogram(
            f"{PREFIX}_weight_receive_seconds",
            "Time to receive each weight version: from its notice through transfer and checks to the swap "
            "(or, behind pinned requests, to its staging).",
            buckets=RECEIVE_BUCKETS_S,
            registry=registry,
        )

    def finished(self, reason: FinishReason, tokens: int) -> None:
        self._sequences_by[reason].inc()
        self._tokens.inc(tokens)

    def received(self, receive_s: float) -> None:
        self._receive.observe(receive_s)

    def swapped(self, stall_s: float) -> None:
        self._stall.observe(stall_s)

    def watch(self, backend: InferenceBackend, receiver: ReceiverStats | None) -> None:
        """Read the backend's status and the receiver's counters (in the event loop) at every scrape."""

        def snapshot() -> Iterator[Metric]:
            status = backend.status()
            yield from gauges(
                PREFIX,
                GAUGES,
                {
                    "running_sequences": status.running,
                    "queued_sequences": status.queued,
                    "tokens_per_second": status.tokens_per_s,
                    "weight_version": status.weight_version.version,
                },
            )
            if status.pinned_waits is not None and status.pinned_wait_s is not None:
                waits = {"weight_pinned_waits": status.pinned_waits,
                         "weight_pinned_wait_seconds": status.pinned_wait_s}  # fmt: skip
                yield from counters(PREFIX, PINNED_COUNTERS, waits)
            if status.decode_steps is not None and status.decoded_rows is not None:
                steps = {
                    "decode_steps": status.decode_steps,
                    "decoded_rows": status.decoded_rows,
                    "prefill_tokens": status.prefill_tokens or 0,
                    "reused_prompt_tokens": status.reused_prompt_tokens or 0,
                }
                yield from counters(PREFIX, BATCH_COUNTERS, steps)
                yield from gauges(PREFIX, KEPT_GAUGES, {"kept_caches": status.kept_caches or 0})
            if receiver is not None:
                yield from _receiver_counters(receiver)

        register_snapshot(self._registry, snapshot)


def _receiver_counters(stats: ReceiverStats) -> Iterator[Metric]:
    yield from counters(
        PREFIX,
        COUNTERS,
        {
            "weight_updates": stats.updates,
            "weight_update_failures": stats.failed_updates,
            "weight_verification_failures": stats.verification_failures,
            "weight_fetch_fallbacks": stats.fetch_fallbacks,
            "weight_abandoned_broadcasts": stats.abandoned_broadcasts,
        },
    )
    transfers = CounterMetricFamily(
        f"{PREFIX}_weight_transfers", "Weight transfers completed, by transport.", labels=["via"]
    )
    for via, count in (
        ("broadcast", stats.broadcasts),
        ("fetch", stats.fetches),
        ("cuda_ipc", stats.cuda_ipc),
    ):
        transfers.add_metric([via], count)
    yield transfers
