"""Prometheus metrics of the coordinator (`pipelinerl_coordinator_*`, listed in
docs/observability.md), all read at each scrape (in the event loop): the runs' progress, the
journal's attempts per state, the inference pool (each server's version and load, re-dispatches)
and the reward pool (each replica's state and load, calls sent again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from pipelinerl.common.metrics import counters, register_snapshot
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.reward_pool import ReplicaState, RewardPool
from pipelinerl.coordinator.types import RunInfo

PREFIX = "pipelinerl_coordinator"
STAGES = ("dispatched", "generated", "scored", "trained", "dropped")

RUN_GAUGES = {
    "samples_per_second": "Samples trained per second, over the last acks.",
    "reward_mean": "Mean reward of the last 256 scored attempts.",
    "correct_ratio": "Fraction of the last 256 scored attempts their verifier marked fully correct.",
    "lag_versions": "Mean lag of the last 256 trained samples' tokens, in versions.",
    "trainer_version": "The trainer's newest version, as its acks report it.",
    "zero_variance_ratio": "Fraction of the last 32 scored groups whose rewards were all equal.",
    "entropy_nats": "Mean negative logprob per generated token of the last 256 attempts (policy entropy).",
}


def _run_gauges(run: RunInfo) -> dict[str, float]:
    p = run.progress
    return {
        "samples_per_second": p.samples_per_s,
        "reward_mean": p.reward_mean,
        "correct_ratio": p.correct_fraction,
        "lag_versions": p.lag_mean,
        "trainer_version": p.trainer_version,
        "zero_variance_ratio": p.zero_variance_fraction,
        "entropy_nats": p.entropy,
    }


def watch(
    registry: CollectorRegistry,
    runs: Callable[[], list[RunInfo]],
    journal_counts: Callable[[str], dict[str, int]],
    pool: InferencePool,
    reward: RewardPool,
) -> None:
    """Read the runs, the journal and both pools at every scrape."""

    def snapshot() -> Iterator[Metric]:
        infos = runs()
        states = GaugeMetricFamily(f"{PREFIX}_runs", "Runs by state.", labels=["state"])
        for state in sorted({run.state.value for run in infos}):
            states.add_metric([state], sum(run.state.value == state for run in infos))
        yield states
        yield from _progress(infos)
        yield from _journal(infos, journal_counts)
        yield from _servers(pool.snapshot())
        yield from _replicas(reward.snapshot())
        docs = {
            "redispatches": "Requests run again after their server went away, was busy or aborted them.",
            "reward_calls": "Score calls made; groups scored in the same turn share one.",
            "reward_retries": "Score calls sent again to another reward replica after theirs failed them.",
        }
        totals = {
            "redispatches": pool.redispatches,
            "reward_calls": reward.calls,
            "reward_retries": reward.retries,
        }
        yield from counters(PREFIX, docs, totals)

    register_snapshot(registry, snapshot)


def _progress(runs: list[RunInfo]) -> Iterator[Metric]:
    stages = CounterMetricFamily(
        f"{PREFIX}_stage_attempts",
        "Attempts through each stage since the run began (across restarts): dispatched, generated, "
        "scored, trained (acked TRAINED or DUPLICATE), dropped (acked DROPPED).",
        labels=["run", "stage"],
    )
    families = {
        name: GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["run"]) for name, doc in RUN_GAUGES.items()
    }
    for run in runs:
        p = run.progress
        for stage, count in zip(
            STAGES, (p.dispatched, p.generated, p.scored, p.trained, p.dropped), strict=True
        ):
            stages.add_metric([run.run_id, stage], count)
        for name, value in _run_gauges(run).items():
            families[name].add_metric([run.run_id], value)
    yield stages
    yield from families.values()


def _journal(runs: list[RunInfo], counts: Callable[[str], dict[str, int]]) -> Iterator[Metric]:
    attempts = GaugeMetricFamily(
        f"{PREFIX}_attempts",
        "Attempts in the journal by state (created, dispatched, generated, scored, trained, acked) and, "
        "once acked, final disposition.",
        labels=["run", "state", "disposition"],
    )
    in_flight = GaugeMetricFamily(
        f"{PREFIX}_attempts_in_flight", "Attempts of the run not yet final (not acked).", labels=["run"]
    )
    for run in runs:
        by_state = counts(run.run_id)
        for key, n in sorted(by_state.items()):
            state, _, disposition = key.partition(":")
            attempts.add_metric([run.run_id, state, disposition], n)
        in_flight.add_metric(
            [run.run_id], sum(n for key, n in by_state.items() if not key.startswith("acked"))
        )
    yield attempts
    yield in_flight


def _servers(servers: list[tuple[str, int, int]]) -> Iterator[Metric]:
    versions = GaugeMetricFamily(
        f"{PREFIX}_server_weight_version", "Weight version each inference server reports.", labels=["server"]
    )
    load = GaugeMetricFamily(
        f"{PREFIX}_server_in_flight", "Requests in flight on each inference server.", labels=["server"]
    )
    for address, version, in_flight in servers:
        versions.add_metric([address], version)
        load.add_metric([address], in_flight)
    yield versions
    yield load


def _replicas(replicas: list[ReplicaState]) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        f"{PREFIX}_reward_replica_up",
        "1 while a reward replica takes Score calls (its health says SERVING, no call failed since).",
        labels=["replica"],
    )
    load = GaugeMetricFamily(
        f"{PREFIX}_reward_replica_in_flight",
        "Score calls in flight on each reward replica.",
        labels=["replica"],
    )
    for replica in replicas:
        up.add_metric([replica.address], float(replica.up))
        load.add_metric([replica.address], replica.in_flight)
    yield up
    yield load
