from google.rpc import status_pb2 as _status_pb2
from pipelinerl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("submit", "cancel", "submit_batch")
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_BATCH_FIELD_NUMBER: _ClassVar[int]
    submit: Submission
    cancel: Cancellation
    submit_batch: SubmissionBatch
    def __init__(self, submit: _Optional[_Union[Submission, _Mapping]] = ..., cancel: _Optional[_Union[Cancellation, _Mapping]] = ..., submit_batch: _Optional[_Union[SubmissionBatch, _Mapping]] = ...) -> None: ...

class SubmissionBatch(_message.Message):
    __slots__ = ("submissions",)
    SUBMISSIONS_FIELD_NUMBER: _ClassVar[int]
    submissions: _containers.RepeatedCompositeFieldContainer[Submission]
    def __init__(self, submissions: _Optional[_Iterable[_Union[Submission, _Mapping]]] = ...) -> None: ...

class Submission(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "prompt_text", "sampling", "stream_tokens", "trace", "weight_version", "prompt_cache_key")
    class TraceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_text: str
    sampling: _common_pb2.SamplingParams
    stream_tokens: bool
    trace: _containers.ScalarMap[str, str]
    weight_version: int
    prompt_cache_key: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt_text: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stream_tokens: _Optional[bool] = ..., trace: _Optional[_Mapping[str, str]] = ..., weight_version: _Optional[int] = ..., prompt_cache_key: _Optional[str] = ...) -> None: ...

class Cancellation(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("capacity", "delta", "completion", "error", "completions")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    capacity: Capacity
    delta: TokenDelta
    completion: Completion
    error: RequestError
    completions: CompletionBatch
    def __init__(self, capacity: _Optional[_Union[Capacity, _Mapping]] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., completion: _Optional[_Union[Completion, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., completions: _Optional[_Union[CompletionBatch, _Mapping]] = ...) -> None: ...

class CompletionBatch(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    def __init__(self, completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ...) -> None: ...

class Capacity(_message.Message):
    __slots__ = ("max_in_flight", "max_new_tokens", "max_context", "model_info", "accepts_batches")
    MAX_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_BATCHES_FIELD_NUMBER: _ClassVar[int]
    max_in_flight: int
    max_new_tokens: int
    max_context: int
    model_info: ModelInfo
    accepts_batches: bool
    def __init__(self, max_in_flight: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_context: _Optional[int] = ..., model_info: _Optional[_Union[ModelInfo, _Mapping]] = ..., accepts_batches: _Optional[bool] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "vocab_size", "eos_token_ids", "pad_token_id", "bos_token_id", "tokenizer", "tokenizer_sha256")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    bos_token_id: int
    tokenizer: str
    tokenizer_sha256: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., tokenizer: _Optional[str] = ..., tokenizer_sha256: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("request_id", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _common_pb2.TokenSequence
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.TokenSequence, _Mapping]] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "completion", "text", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion: _common_pb2.TokenSequence
    text: str
    finish_reason: _common_pb2.FinishReason
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion: _Optional[_Union[_common_pb2.TokenSequence, _Mapping]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "status")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    status: _status_pb2.Status
    def __init__(self, request_id: _Optional[str] = ..., status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("weight_version", "running", "queued", "tokens_per_s", "max_running", "weight_updates", "failed_weight_updates", "engine", "model", "model_info")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    FAILED_WEIGHT_UPDATES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFO_FIELD_NUMBER: _ClassVar[int]
    weight_version: _common_pb2.WeightVersion
    running: int
    queued: int
    tokens_per_s: float
    max_running: int
    weight_updates: int
    failed_weight_updates: int
    engine: str
    model: str
    model_info: ModelInfo
    def __init__(self, weight_version: _Optional[_Union[_common_pb2.WeightVersion, _Mapping]] = ..., running: _Optional[int] = ..., queued: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., max_running: _Optional[int] = ..., weight_updates: _Optional[int] = ..., failed_weight_updates: _Optional[int] = ..., engine: _Optional[str] = ..., model: _Optional[str] = ..., model_info: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...
