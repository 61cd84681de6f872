"""Coordinator messages <-> coordinator domain types, both directions (servicer and client)."""

from __future__ import annotations

import dataclasses
import re
from datetime import UTC, datetime

from google.protobuf import duration_pb2, timestamp_pb2

from pipelinerl.common import convert
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.v1 import common_pb2 as common_pb
from pipelinerl.coordinator.types import (
    EpisodeStats,
    EvaluationResult,
    EvaluationSpec,
    InferenceRole,
    Mode,
    Progress,
    RunInfo,
    RunSpec,
    RunState,
    ServerVersion,
)
from pipelinerl.coordinator.v1 import coordinator_pb2 as pb
from pipelinerl.reward.types import MAX_BATCH_ITEMS
from pipelinerl.trainer.types import MAX_SAMPLES_PER_MESSAGE

RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# A group is scored in one reward call and sent to the trainer in one message.
MAX_GROUP_SIZE = min(MAX_BATCH_ITEMS, MAX_SAMPLES_PER_MESSAGE)

_MODES = {Mode.PIPELINE: pb.MODE_PIPELINE, Mode.SYNC: pb.MODE_SYNC}
_MODE_NAMES = {v: k for k, v in _MODES.items()}
_ROLES = {
    InferenceRole.TRAINING: pb.INFERENCE_ROLE_TRAINING,
    InferenceRole.EVALUATION: pb.INFERENCE_ROLE_EVALUATION,
}
_ROLE_NAMES: dict[int, InferenceRole] = {pb.INFERENCE_ROLE_UNSPECIFIED: InferenceRole.TRAINING}
_ROLE_NAMES.update((v, k) for k, v in _ROLES.items())
_STATES = {
    RunState.RUNNING: pb.RUN_STATE_RUNNING,
    RunState.STOPPING: pb.RUN_STATE_STOPPING,
    RunState.STOPPED: pb.RUN_STATE_STOPPED,
    RunState.COMPLETED: pb.RUN_STATE_COMPLETED,
    RunState.FAILED: pb.RUN_STATE_FAILED,
}
_STATE_NAMES = {v: k for k, v in _STATES.items()}


def run_id_from_proto(run_id: str, field: str = "run_id") -> str:
    if not RUN_ID.match(run_id):
        raise InvalidArgument.field(field, "must be 1 to 64 letters, digits, '-' or '_'")
    return run_id


def spec_to_proto(spec: RunSpec) -> pb.RunSpec:
    return pb.RunSpec(
        dataset=spec.dataset,
        group_size=spec.group_size,
        max_samples=spec.max_samples,
        sampling=convert.sampling_to_proto(spec.sampling),
        mode=_MODES[spec.mode],
        max_in_flight=spec.max_in_flight,
        seed=spec.seed,
        environment=spec.environment,
        max_turns=spec.max_turns,
        evaluations=[evaluation_to_proto(e) for e in spec.evaluations],
        epochs=spec.epochs,
        eval_split=spec.eval_split,
    )


def evaluation_to_proto(spec: EvaluationSpec) -> pb.EvaluationSpec:
    return pb.EvaluationSpec(
        dataset=spec.dataset,
        every_versions=spec.every_versions,
        samples_per_problem=spec.samples_per_problem,
        sampling=convert.sampling_to_proto(spec.sampling),
        max_problems=spec.max_problems,
    )


def evaluation_from_proto(
    msg: pb.EvaluationSpec, field: str = "evaluation", run_sampling: common_pb.SamplingParams | None = None
) -> EvaluationSpec:
    """The set of a run (`run_sampling`: the run's, whose `max_new_tokens` stands in for an unset
    one), or, without `run_sampling`, one evaluated once (Evaluate): its `every_versions` means
    nothing there, and its `max_new_tokens` has no run's to fall back on."""
    checks = [
        (bool(msg.dataset), "dataset", "must name a set"),
        (run_sampling is None or msg.every_versions >= 1, "every_versions", "must be at least 1"),
        (msg.samples_per_problem >= 1, "samples_per_problem", "must be at least 1"),
        (
            msg.samples_per_problem <= MAX_GROUP_SIZE,
            "samples_per_problem",
            f"must be at most {MAX_GROUP_SIZE}",
        ),
        (msg.max_problems >= 0, "max_problems", "must be >= 0"),
    ]
    for ok, name, why in checks:
        if not ok:
            raise InvalidArgument.field(f"{field}.{name}", why)
    sampling = common_pb.SamplingParams()
    sampling.CopyFrom(msg.sampling)
    if run_sampling is not None:
        sampling.max_new_tokens = sampling.max_new_tokens or run_sampling.max_new_tokens
    return EvaluationSpec(
        dataset=msg.dataset,
        every_versions=msg.every_versions,
        samples_per_problem=msg.samples_per_problem,
        sampling=convert.sampling_from_proto(sampling, f"{field}.sampling"),
        max_problems=msg.max_problems,
    )


def spec_from_proto(msg: pb.RunSpec, field: str = "spec") -> RunSpec:
    checks = [
        (bool(msg.dataset) or bool(msg.environment), "dataset", "must name a dataset"),
        (not (msg.dataset and msg.environment), "dataset", "must be empty in an environment run"),
        (msg.max_turns >= 0, "max_turns", "must be >= 0"),
        (msg.group_size >= 2, "group_size", "must be at least 2"),
        (msg.group_size <= MAX_GROUP_SIZE, "group_size", f"must be at most {MAX_GROUP_SIZE}"),
        (msg.max_samples >= 0, "max_samples", "must be >= 0"),
        (msg.mode in _MODE_NAMES, "mode", "must be MODE_PIPELINE or MODE_SYNC"),
        (msg.max_in_flight >= msg.group_size, "max_in_flight", "must be at least group_size"),
        (msg.epochs >= 0, "epochs", "must be >= 0"),
        (0.0 <= msg.eval_split <= 0.5, "eval_split", "must be in [0, 0.5]"),
        (
            len({e.dataset for e in msg.evaluations}) == len(msg.evaluations),
            "evaluations",
            "must name each set once",
        ),
    ]
    for ok, name, why in checks:
        if not ok:
            raise InvalidArgument.field(f"{field}.{name}", why)
    return RunSpec(
        dataset=msg.dataset,
        group_size=msg.group_size,
        max_samples=msg.max_samples,
        sampling=convert.sampling_from_proto(msg.sampling, f"{field}.sampling"),
        mode=_MODE_NAMES[msg.mode],
        max_in_flight=msg.max_in_flight,
        seed=msg.seed,
        environment=msg.environment,
        max_turns=msg.max_turns,
        evaluations=tuple(
            evaluation_from_proto(e, f"{field}.evaluations[{i}]", msg.sampling)
            for i, e in enumerate(msg.evaluations)
        ),
        epochs=max(msg.epochs, 1),
        eval_split=msg.eval_split,
    )


def progress_to_proto(p: Progress) -> pb.Progress:
    return pb.Progress(
        dispatched=p.dispatched,
        generated=p.generated,
        scored=p.scored,
        trained=p.trained,
        dropped=p.dropped,
        samples_per_s=p.samples_per_s,
        reward_mean=p.reward_mean,
        correct_fraction=p.correct_fraction,
        lag_mean=p.lag_mean,
        trainer_version=p.trainer_version,
        servers=[
            pb.ServerVersion(address=s.address, version=s.version, in_flight=s.in_flight) for s in p.servers
        ],
        zero_variance_fraction=p.zero_variance_fraction,
        entropy=p.entropy,
        episodes=pb.EpisodeStats(**dataclasses.asdict(p.episodes)) if p.episodes else None,
    )


def progress_from_proto(msg: pb.Progress) -> Progress:
    return Progress(
        dispatched=msg.dispatched,
        generated=msg.generated,
        scored=msg.scored,
        trained=msg.trained,
        dropped=msg.dropped,
        samples_per_s=msg.samples_per_s,
        reward_mean=msg.reward_mean,
        correct_fraction=msg.correct_fraction,
        lag_mean=msg.lag_mean,
        trainer_version=msg.trainer_version,
        servers=tuple(ServerVersion(s.address, s.version, s.in_flight) for s in msg.servers),
        zero_variance_fraction=msg.zero_variance_fraction,
        entropy=msg.entropy,
        episodes=_episodes_from_proto(msg.episodes) if msg.HasField("episodes") else None,
    )


def _episodes_from_proto(msg: pb.EpisodeStats) -> EpisodeStats:
    return EpisodeStats(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(EpisodeStats)})


def run_to_proto(run: RunInfo) -> pb.Run:
    started = timestamp_pb2.Timestamp()
    started.FromDatetime(run.started_at)
    return pb.Run(
        run_id=run.run_id,
        spec=spec_to_proto(run.spec),
        state=_STATES[run.state],
        progress=progress_to_proto(run.progress),
        started_at=started,
        error=run.error,
        evaluations=[evaluation_result_to_proto(e) for e in run.evaluations],
    )


def evaluation_result_to_proto(r: EvaluationResult) -> pb.EvaluationResult:
    finished = timestamp_pb2.Timestamp()
    finished.FromDatetime(r.finished_at)
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(r.duration_s * 1e9))
    fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    del fields["finished_at"], fields["duration_s"]
    return pb.EvaluationResult(**fields, finished_at=finished, duration=duration)


def evaluation_result_from_proto(msg: pb.EvaluationResult) -> EvaluationResult:
    plain = {f.name for f in dataclasses.fields(EvaluationResult)} - {"finished_at", "duration_s"}
    return EvaluationResult(
        **{name: getattr(msg, name) for name in plain},
        finished_at=_datetime_from_proto(msg.finished_at, "finished_at"),
        duration_s=msg.duration.ToNanoseconds() / 1e9,
    )


def _datetime_from_proto(msg: timestamp_pb2.Timestamp, field: str) -> datetime:
    try:
        return msg.ToDatetime(tzinfo=UTC)
    except ValueError as exc:  # outside the years 1 to 9999
        raise InvalidArgument.field(field, str(exc)) from exc


def run_from_proto(msg: pb.Run) -> RunInfo:
    return RunInfo(
        run_id=msg.run_id,
        spec=spec_from_proto(msg.spec),
        state=_STATE_NAMES[msg.state],
        progress=progress_from_proto(msg.progress),
        started_at=_datetime_from_proto(msg.started_at, "started_at"),
        error=msg.error,
        evaluations=tuple(evaluation_result_from_proto(e) for e in msg.evaluations),
    )


def role_to_proto(role: InferenceRole) -> pb.InferenceRole:
    return _ROLES[role]


def role_from_proto(role: pb.InferenceRole.ValueType) -> InferenceRole:
    """Unspecified (a server that predates the field) is training; InvalidArgument for an unknown value."""
    if role not in _ROLE_NAMES:
        raise InvalidArgument.field("role", f"unknown inference role {role}")
    return _ROLE_NAMES[role]
