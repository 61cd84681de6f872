import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from pipelinerl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODE_UNSPECIFIED: _ClassVar[Mode]
    MODE_PIPELINE: _ClassVar[Mode]
    MODE_SYNC: _ClassVar[Mode]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_STOPPING: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_COMPLETED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]

class InferenceRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFERENCE_ROLE_UNSPECIFIED: _ClassVar[InferenceRole]
    INFERENCE_ROLE_TRAINING: _ClassVar[InferenceRole]
    INFERENCE_ROLE_EVALUATION: _ClassVar[InferenceRole]
MODE_UNSPECIFIED: Mode
MODE_PIPELINE: Mode
MODE_SYNC: Mode
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_STOPPING: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_COMPLETED: RunState
RUN_STATE_FAILED: RunState
INFERENCE_ROLE_UNSPECIFIED: InferenceRole
INFERENCE_ROLE_TRAINING: InferenceRole
INFERENCE_ROLE_EVALUATION: InferenceRole

class RunSpec(_message.Message):
    __slots__ = ("dataset", "group_size", "max_samples", "sampling", "mode", "max_in_flight", "seed", "environment", "max_turns", "evaluations", "epochs", "eval_split")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    EVAL_SPLIT_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    group_size: int
    max_samples: int
    sampling: _common_pb2.SamplingParams
    mode: Mode
    max_in_flight: int
    seed: int
    environment: str
    max_turns: int
    evaluations: _containers.RepeatedCompositeFieldContainer[EvaluationSpec]
    epochs: int
    eval_split: float
    def __init__(self, dataset: _Optional[str] = ..., group_size: _Optional[int] = ..., max_samples: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[Mode, str]] = ..., max_in_flight: _Optional[int] = ..., seed: _Optional[int] = ..., environment: _Optional[str] = ..., max_turns: _Optional[int] = ..., evaluations: _Optional[_Iterable[_Union[EvaluationSpec, _Mapping]]] = ..., epochs: _Optional[int] = ..., eval_split: _Optional[float] = ...) -> None: ...

class EvaluationSpec(_message.Message):
    __slots__ = ("dataset", "every_versions", "samples_per_problem", "sampling", "max_problems")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EVERY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    every_versions: int
    samples_per_problem: int
    sampling: _common_pb2.SamplingParams
    max_problems: int
    def __init__(self, dataset: _Optional[str] = ..., every_versions: _Optional[int] = ..., samples_per_problem: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., max_problems: _Optional[int] = ...) -> None: ...

class EvaluationResult(_message.Message):
    __slots__ = ("dataset", "weight_version", "problems", "samples_per_problem", "reward_mean", "pass_at_1", "pass_at_k", "completion_tokens_mean", "truncated_fraction", "finished_at", "duration", "server")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_PROBLEM_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_1_FIELD_NUMBER: _ClassVar[int]
    PASS_AT_K_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    weight_version: int
    problems: int
    samples_per_problem: int
    reward_mean: float
    pass_at_1: float
    pass_at_k: float
    completion_tokens_mean: float
    truncated_fraction: float
    finished_at: _timestamp_pb2.Timestamp
    duration: _duration_pb2.Duration
    server: str
    def __init__(self, dataset: _Optional[str] = ..., weight_version: _Optional[int] = ..., problems: _Optional[int] = ..., samples_per_problem: _Optional[int] = ..., reward_mean: _Optional[float] = ..., pass_at_1: _Optional[float] = ..., pass_at_k: _Optional[float] = ..., completion_tokens_mean: _Optional[float] = ..., truncated_fraction: _Optional[float] = ..., finished_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., server: _Optional[str] = ...) -> None: ...

class ServerVersion(_message.Message):
    __slots__ = ("address", "version", "in_flight")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    address: str
    version: int
    in_flight: int
    def __init__(self, address: _Optional[str] = ..., version: _Optional[int] = ..., in_flight: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("dispatched", "generated", "scored", "trained", "dropped", "samples_per_s", "reward_mean", "correct_fraction", "lag_mean", "trainer_version", "servers", "zero_variance_fraction", "entropy", "episodes")
    DISPATCHED_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    SCORED_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    CORRECT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    LAG_MEAN_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    ZERO_VARIANCE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    dispatched: int
    generated: int
    scored: int
    trained: int
    dropped: int
    samples_per_s: float
    reward_mean: float
    correct_fraction: float
    lag_mean: float
    trainer_version: int
    servers: _containers.RepeatedCompositeFieldContainer[ServerVersion]
    zero_variance_fraction: float
    entropy: float
    episodes: EpisodeStats
    def __init__(self, dispatched: _Optional[int] = ..., generated: _Optional[int] = ..., scored: _Optional[int] = ..., trained: _Optional[int] = ..., dropped: _Optional[int] = ..., samples_per_s: _Optional[float] = ..., reward_mean: _Optional[float] = ..., correct_fraction: _Optional[float] = ..., lag_mean: _Optional[float] = ..., trainer_version: _Optional[int] = ..., servers: _Optional[_Iterable[_Union[ServerVersion, _Mapping]]] = ..., zero_variance_fraction: _Optional[float] = ..., entropy: _Optional[float] = ..., episodes: _Optional[_Union[EpisodeStats, _Mapping]] = ...) -> None: ...

class EpisodeStats(_message.Message):
    __slots__ = ("episodes", "turns_mean", "tool_calls", "truncated", "forks", "environment_errors", "step_seconds_mean", "prefill_tokens_mean")
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    TURNS_MEAN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_ERRORS_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_MEAN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_MEAN_FIELD_NUMBER: _ClassVar[int]
    episodes: int
    turns_mean: float
    tool_calls: int
    truncated: int
    forks: int
    environment_errors: int
    step_seconds_mean: float
    prefill_tokens_mean: float
    def __init__(self, episodes: _Optional[int] = ..., turns_mean: _Optional[float] = ..., tool_calls: _Optional[int] = ..., truncated: _Optional[int] = ..., forks: _Optional[int] = ..., environment_errors: _Optional[int] = ..., step_seconds_mean: _Optional[float] = ..., prefill_tokens_mean: _Optional[float] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "spec", "state", "progress", "started_at", "error", "evaluations")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EVALUATIONS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: RunSpec
    state: RunState
    progress: Progress
    started_at: _timestamp_pb2.Timestamp
    error: str
    evaluations: _containers.RepeatedCompositeFieldContainer[EvaluationResult]
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ..., state: _Optional[_Union[RunState, str]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error: _Optional[str] = ..., evaluations: _Optional[_Iterable[_Union[EvaluationResult, _Mapping]]] = ...) -> None: ...

class StartRunRequest(_message.Message):
    __slots__ = ("run_id", "spec")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    spec: RunSpec
    def __init__(self, run_id: _Optional[str] = ..., spec: _Optional[_Union[RunSpec, _Mapping]] = ...) -> None: ...

class StartRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class StopRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class WatchRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class WatchRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class RegisterInferenceServerRequest(_message.Message):
    __slots__ = ("address", "leaving", "role")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    leaving: bool
    role: InferenceRole
    def __init__(self, address: _Optional[str] = ..., leaving: _Optional[bool] = ..., role: _Optional[_Union[InferenceRole, str]] = ...) -> None: ...

class RegisterInferenceServerResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: _duration_pb2.Duration
    def __init__(self, lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class EvaluateRequest(_message.Message):
    __slots__ = ("evaluation",)
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    evaluation: EvaluationSpec
    def __init__(self, evaluation: _Optional[_Union[EvaluationSpec, _Mapping]] = ...) -> None: ...

class EvaluateResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: EvaluationResult
    def __init__(self, result: _Optional[_Union[EvaluationResult, _Mapping]] = ...) -> None: ...
