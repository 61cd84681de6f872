"""Prometheus metrics of the coordinator (`pipelinerl_coordinator_*`, listed in
docs/observability.md), all read at each scrape (in the event loop): the runs' progress, the
journal's attempts per state, the inference pool (each server's version and load, re-dispatches),
the reward and environment pools (each replica's state and load, calls sent again), the episodes
of environment runs and the latest held-out evaluation of each set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from pipelinerl.common.metrics import counters, register_snapshot
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.replicas import ReplicaPool, ReplicaState
from pipelinerl.coordinator.reward_pool import RewardPool
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


EPISODE_GAUGES = {
    "episode_turns_mean": "Mean model turns of the last 256 episodes of an environment run.",
    "environment_step_seconds_mean": "Mean seconds of the last 256 StepEpisode calls.",
    "episode_prefill_tokens_mean": "Mean prompt tokens prefilled per episode (all turns), last 256.",
}
EPISODE_COUNTERS = {
    "episodes": "Episodes played to their end (restarts not counted).",
    "tool_calls": "Tool calls the model made in episodes.",
    "episodes_truncated": "Episodes ended truncated (by the environment, turns, context or max_new_tokens).",
    "episode_forks": "Episodes whose tokens could not be proven equal to a full render (sample cut there).",
    "environment_errors": "Environment calls that failed; each restarted its episode from the start.",
}


EVALUATION_GAUGES = {
    "eval_weight_version": "Weight version of the latest evaluation of each held-out set.",
    "eval_pass_at_1": "Fraction of exactly correct completions in the latest evaluation of each set.",
    "eval_pass_at_k": "Unbiased pass@k (k: completions per problem) of the latest evaluation of each set.",
    "eval_reward_mean": "Mean reward of the latest evaluation of each held-out set.",
    "eval_completion_tokens_mean": "Mean completion length, in tokens, of the latest evaluation of each set.",
    "eval_truncated_ratio": "Fraction of completions cut by max_new_tokens in the latest evaluation.",
    "eval_duration_seconds": "How long the latest evaluation of each set took.",
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
    environments: ReplicaPool[Any],
) -> None:
    """Read the runs, the journal and the pools at every scrape."""

    def snapshot() -> Iterator[Metric]:
        infos = runs()
        states = GaugeMetricFamily(f"{PREFIX}_runs", "Runs by state.", labels=["state"])
        for state in sorted({run.state.value for run in infos}):
            states.add_metric([state], sum(run.state.value == state for run in infos))
        yield states
        yield from _progress(infos)
        yield from _journal(infos, journal_counts)
        yield from _servers(pool.snapshot())
        yield from _replicas("reward", reward.snapshot())
        yield from _replicas("environment", environments.snapshot())
        yield from _episodes(infos)
        yield from _evaluations(infos)
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


def _episodes(runs: list[RunInfo]) -> Iterator[Metric]:
    gauges = {n: GaugeMetricFamily(f"{PREFIX}_{n}", doc, labels=["run"]) for n, doc in EPISODE_GAUGES.items()}
    totals = {
        n: CounterMetricFamily(f"{PREFIX}_{n}", doc, labels=["run"]) for n, doc in EPISODE_COUNTERS.items()
    }
    for run in runs:
        if (e := run.progress.episodes) is None:
            continue
        values = {
            "episode_turns_mean": e.turns_mean,
            "environment_step_seconds_mean": e.step_seconds_mean,
            "episode_prefill_tokens_mean": e.prefill_tokens_mean,
            "episodes": e.episodes,
            "tool_calls": e.tool_calls,
            "episodes_truncated": e.truncated,
            "episode_forks": e.forks,
            "environment_errors": e.environment_errors,
        }
        for name, family in (gauges | totals).items():
            family.add_metric([run.run_id], values[name])
    yield from gauges.values()
    yield from totals.values()


def _evaluations(runs: list[RunInfo]) -> Iterator[Metric]:
    gauges = {
        n: GaugeMetricFamily(f"{PREFIX}_{n}", doc, labels=["run", "dataset"])
        for n, doc in EVALUATION_GAUGES.items()
    }
    for run in runs:
        latest = {e.dataset: e for e in run.evaluations}  # oldest first: the last of each set stays
        for dataset, e in latest.items():
            values = {
                "eval_weight_version": e.weight_version,
                "eval_pass_at_1": e.pass_at_1,
                "eval_pass_at_k": e.pass_at_k,
                "eval_reward_mean": e.reward_mean,
                "eval_completion_tokens_mean": e.completion_tokens_mean,
                "eval_truncated_ratio": e.truncated_fraction,
                "eval_duration_seconds": e.duration_s,
            }
            for name, family in gauges.items():
                family.add_metric([run.run_id, dataset], values[name])
    yield from gauges.values()


def _replicas(kind: str, replicas: list[ReplicaState]) -> Iterator[Metric]:
    calls = {"reward": "Score calls", "environment": "episodes"}[kind]
    up = GaugeMetricFamily(
        f"{PREFIX}_{kind}_replica_up",
        f"1 while a {kind} replica takes {calls} (its health says SERVING, no call failed since).",
        labels=["replica"],
    )
    load = GaugeMetricFamily(
        f"{PREFIX}_{kind}_replica_in_flight",
        f"{calls.capitalize()} in flight on each {kind} replica.",
        labels=["replica"],
    )
    for replica in replicas:
        up.add_metric([replica.address], float(replica.up))
        load.add_metric([replica.address], replica.in_flight)
    yield up
    yield load
