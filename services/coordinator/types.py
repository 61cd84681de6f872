"""Domain types of the coordinator, and the core the servicer calls (`coordinator.Coordinator`),
free of protobuf and grpc."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from pipelinerl.common.types import SamplingParams


class Mode(enum.Enum):
    PIPELINE = "pipeline"
    """Generation, scoring and training overlap; weights update in flight."""
    SYNC = "sync"
    """Conventional baseline: generate a batch, score, train, repeat."""


class InferenceRole(enum.Enum):
    """What an inference server is for: the pool it joins."""

    TRAINING = "training"
    """Generates the attempts runs train on (and evaluates when no evaluation server is connected)."""
    EVALUATION = "evaluation"
    """Serves held-out evaluations only."""


class RunState(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def final(self) -> bool:
        """The run has ended: no other state follows."""
        return self in (RunState.STOPPED, RunState.COMPLETED, RunState.FAILED)


@dataclass(frozen=True)
class RunSpec:
    dataset: str
    """`builtin:<task>` or a path to a local JSONL/parquet file."""
    group_size: int = 8
    max_samples: int = 0
    """Draw no new group once this many attempts have been drawn, counted across restarts (a
    group is drawn whole, so the last may pass it); the run completes once every attempt is
    final. 0 means no limit."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mode: Mode = Mode.PIPELINE
    max_in_flight: int = 64
    """Most attempts between dispatch and final ack; in sync mode, the attempts of one round."""
    seed: int = 0
    """Seeds the built-in tasks' problems, the shuffle of a file dataset, an environment's episodes."""
    environment: str = ""
    """The environment whose episodes the run trains on (its DescribeEnvironment name); empty for
    single-turn prompts from `dataset`."""
    max_turns: int = 0
    """Most model turns per episode; 0: the environment's limit."""
    evaluations: tuple[EvaluationSpec, ...] = ()
    """Held-out sets evaluated while the run trains (evaluation.py)."""
    epochs: int = 1
    """Passes over a file dataset, each in an order of its own; built-in tasks are endless."""
    eval_split: float = 0.0
    """Fraction of a file dataset's rows held out from training, chosen by `seed`."""


@dataclass(frozen=True)
class EvaluationSpec:
    """One held-out set of a run (`pipelinerl.coordinator.v1.EvaluationSpec`)."""

    dataset: str
    """`builtin:<task>[:<size>]` (its held-out problems), a JSONL/parquet file, or
    `environment:<name>`."""
    every_versions: int = 16
    """Evaluated at the run's first version, every this many versions, and at its last."""
    samples_per_problem: int = 1
    """Completions per problem: the k of pass@k."""
    sampling: SamplingParams = field(default_factory=lambda: SamplingParams(temperature=0.0))
    """Temperature 0 is greedy; `max_new_tokens` 0 takes the run's."""
    max_problems: int = 0
    """The first this many problems of the set; 0: all of a file, 256 of an endless set."""


@dataclass(frozen=True)
class EvaluationResult:
    """What one evaluation of one set at one weight version measured."""

    dataset: str
    weight_version: int
    """The version that generated every token of every completion."""
    problems: int
    samples_per_problem: int
    reward_mean: float
    pass_at_1: float
    pass_at_k: float
    completion_tokens_mean: float
    truncated_fraction: float
    finished_at: datetime
    duration_s: float
    server: str

    def to_json(self) -> dict[str, Any]:
        """Its fields as JSON values, `finished_at` in ISO 8601: as the journal, `metrics.jsonl` and
        `pipelinerl eval` keep it."""
        return {**dataclasses.asdict(self), "finished_at": self.finished_at.isoformat()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EvaluationResult:
        """The inverse of `to_json`."""
        return cls(**{**data, "finished_at": datetime.fromisoformat(data["finished_at"])})


@dataclass(frozen=True)
class ServerVersion:
    address: str
    version: int
    in_flight: int


@dataclass(frozen=True)
class EpisodeStats:
    """What the episodes of an environment run did (`pipelinerl.coordinator.v1.EpisodeStats`)."""

    episodes: int = 0
    turns_mean: float = 0.0
    tool_calls: int = 0
    truncated: int = 0
    forks: int = 0
    environment_errors: int = 0
    step_seconds_mean: float = 0.0
    prefill_tokens_mean: float = 0.0


@dataclass(frozen=True)
class Progress:
    dispatched: int = 0
    generated: int = 0
    scored: int = 0
    trained: int = 0
    dropped: int = 0
    samples_per_s: float = 0.0
    reward_mean: float = 0.0
    correct_fraction: float = 0.0
    lag_mean: float = 0.0
    trainer_version: int = 0
    servers: tuple[ServerVersion, ...] = ()
    zero_variance_fraction: float = 0.0
    """Of the last window of scored groups, those whose rewards were all equal."""
    entropy: float = 0.0
    """Mean negative logprob of the last window's generated tokens: the policy's entropy per token."""
    episodes: EpisodeStats | None = None
    """Environment runs only."""


@dataclass(frozen=True)
class RunInfo:
    run_id: str
    spec: RunSpec
    state: RunState
    progress: Progress
    started_at: datetime
    error: str = ""
    evaluations: tuple[EvaluationResult, ...] = ()
    """Every evaluation completed so far, oldest first."""


class CoordinatorCore(Protocol):
    """The coordinator as the servicer sees it."""

    async def start_run(self, run_id: str, spec: RunSpec) -> RunInfo:
        """Start, or return the run already started under this id (idempotent)."""
        ...

    def get_run(self, run_id: str) -> RunInfo:
        """NotFound for an unknown id."""
        ...

    async def stop_run(self, run_id: str) -> RunInfo: ...

    async def evaluate(self, spec: EvaluationSpec) -> EvaluationResult:
        """`spec`'s set evaluated once outside any run (`every_versions` ignored), at the newest
        version an inference server holds; nothing trained or journaled."""
        ...

    def watch_run(self, run_id: str) -> AsyncIterator[RunInfo]:
        """The run at once, at each change of its state and about once a second between; the
        last message is the run's final state, however slowly the watcher reads."""
        ...
