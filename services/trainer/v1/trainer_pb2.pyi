from google.rpc import status_pb2 as _status_pb2
from pipelinerl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Disposition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DISPOSITION_UNSPECIFIED: _ClassVar[Disposition]
    DISPOSITION_ACCEPTED: _ClassVar[Disposition]
    DISPOSITION_TRAINED: _ClassVar[Disposition]
    DISPOSITION_DUPLICATE: _ClassVar[Disposition]
    DISPOSITION_DROPPED: _ClassVar[Disposition]
    DISPOSITION_REJECTED: _ClassVar[Disposition]
DISPOSITION_UNSPECIFIED: Disposition
DISPOSITION_ACCEPTED: Disposition
DISPOSITION_TRAINED: Disposition
DISPOSITION_DUPLICATE: Disposition
DISPOSITION_DROPPED: Disposition
DISPOSITION_REJECTED: Disposition

class SubmitSamplesRequest(_message.Message):
    __slots__ = ("samples", "flush", "checkpoint")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FLUSH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    flush: bool
    checkpoint: bool
    def __init__(self, samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., flush: _Optional[bool] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class SampleAck(_message.Message):
    __slots__ = ("sample_id", "disposition", "version", "error")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    DISPOSITION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    disposition: Disposition
    version: int
    error: _status_pb2.Status
    def __init__(self, sample_id: _Optional[str] = ..., disposition: _Optional[_Union[Disposition, str]] = ..., version: _Optional[int] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ...) -> None: ...

class SubmitSamplesResponse(_message.Message):
    __slots__ = ("acks", "durable_version")
    ACKS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    acks: _containers.RepeatedCompositeFieldContainer[SampleAck]
    durable_version: int
    def __init__(self, acks: _Optional[_Iterable[_Union[SampleAck, _Mapping]]] = ..., durable_version: _Optional[int] = ...) -> None: ...

class WatchWeightsRequest(_message.Message):
    __slots__ = ("receiver_id", "current_version", "accepts_broadcast", "cuda_device_uuid")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTS_BROADCAST_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    current_version: int
    accepts_broadcast: bool
    cuda_device_uuid: str
    def __init__(self, receiver_id: _Optional[str] = ..., current_version: _Optional[int] = ..., accepts_broadcast: _Optional[bool] = ..., cuda_device_uuid: _Optional[str] = ...) -> None: ...

class WatchWeightsResponse(_message.Message):
    __slots__ = ("version", "layout", "broadcast", "cuda_ipc")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.WeightVersion
    layout: _common_pb2.WeightLayout
    broadcast: BroadcastRendezvous
    cuda_ipc: CudaIpcBuckets
    def __init__(self, version: _Optional[_Union[_common_pb2.WeightVersion, _Mapping]] = ..., layout: _Optional[_Union[_common_pb2.WeightLayout, _Mapping]] = ..., broadcast: _Optional[_Union[BroadcastRendezvous, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcBuckets, _Mapping]] = ...) -> None: ...

class CudaIpcBuckets(_message.Message):
    __slots__ = ("device_uuid", "buckets")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    buckets: _containers.RepeatedCompositeFieldContainer[CudaIpcBucket]
    def __init__(self, device_uuid: _Optional[str] = ..., buckets: _Optional[_Iterable[_Union[CudaIpcBucket, _Mapping]]] = ...) -> None: ...

class CudaIpcBucket(_message.Message):
    __slots__ = ("index", "num_bytes", "handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    num_bytes: int
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    checksum: bytes
    def __init__(self, index: _Optional[int] = ..., num_bytes: _Optional[int] = ..., handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class BroadcastRendezvous(_message.Message):
    __slots__ = ("backend", "host", "port", "group_name", "world_size", "rank", "timeout_ms")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    host: str
    port: int
    group_name: str
    world_size: int
    rank: int
    timeout_ms: int
    def __init__(self, backend: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., group_name: _Optional[str] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("version", "buckets")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.WeightVersion
    buckets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[_Union[_common_pb2.WeightVersion, _Mapping]] = ..., buckets: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchWeightsResponse(_message.Message):
    __slots__ = ("chunk",)
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    chunk: _common_pb2.TensorChunk
    def __init__(self, chunk: _Optional[_Union[_common_pb2.TensorChunk, _Mapping]] = ...) -> None: ...

class ReleaseWeightsRequest(_message.Message):
    __slots__ = ("receiver_id", "version")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    version: _common_pb2.WeightVersion
    def __init__(self, receiver_id: _Optional[str] = ..., version: _Optional[_Union[_common_pb2.WeightVersion, _Mapping]] = ...) -> None: ...

class ReleaseWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("version", "buffered_samples", "trained_samples", "dropped_samples", "rejected_samples", "tokens_per_s", "watchers", "durable_version", "max_lag")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_LAG_FIELD_NUMBER: _ClassVar[int]
    version: _common_pb2.WeightVersion
    buffered_samples: int
    trained_samples: int
    dropped_samples: int
    rejected_samples: int
    tokens_per_s: float
    watchers: int
    durable_version: int
    max_lag: int
    def __init__(self, version: _Optional[_Union[_common_pb2.WeightVersion, _Mapping]] = ..., buffered_samples: _Optional[int] = ..., trained_samples: _Optional[int] = ..., dropped_samples: _Optional[int] = ..., rejected_samples: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., watchers: _Optional[int] = ..., durable_version: _Optional[int] = ..., max_lag: _Optional[int] = ...) -> None: ...
