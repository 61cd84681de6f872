"""Domain view of a weight version on the wire: the layout of tensors in flat buckets, the notice a
trainer sends when a version is ready, and the chunks `FetchWeights` streams.

The weight publisher (trainer side) and receivers (inference side) speak these types; they meet
their `pipelinerl.common.v1` messages in `pipelinerl.weights.convert`, the notice and watch request
(`pipelinerl.trainer.v1`) in `pipelinerl.trainer.convert`.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass

from pipelinerl.common.types import WeightVersion

MAX_CHUNK_BYTES = 4 * 1024 * 1024


class ChecksumAlgorithm(enum.Enum):
    CRC32 = "crc32"
    SHA256 = "sha256"


def crc32(data: bytes | memoryview) -> bytes:
    """CRC-32 (zlib) as 4 big-endian bytes: the default bucket and chunk checksum."""
    return zlib.crc32(data).to_bytes(4, "big")


@dataclass(frozen=True)
class Checksum:
    algorithm: ChecksumAlgorithm
    value: bytes


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor sits inside its bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """`float32`, `float16` or `bfloat16` (torch dtype names)."""
    bucket: int
    offset: int
    num_bytes: int


@dataclass(frozen=True)
class BucketSpec:
    index: int
    num_bytes: int
    checksum: Checksum


@dataclass(frozen=True)
class WeightLayout:
    tensors: tuple[TensorSpec, ...]
    buckets: tuple[BucketSpec, ...]

    @property
    def total_bytes(self) -> int:
        return sum(b.num_bytes for b in self.buckets)


@dataclass(frozen=True)
class Rendezvous:
    """Where one receiver joins the torch.distributed broadcast of one version."""

    backend: str
    host: str
    port: int
    group_name: str
    world_size: int
    rank: int
    timeout_ms: int


@dataclass(frozen=True)
class WatchRequest:
    """An inference server asking to follow weight versions (`WatchWeights`)."""

    receiver_id: str
    current_version: int
    accepts_broadcast: bool
    cuda_device_uuid: str = ""
    """The GPU the receiver can open CUDA IPC handles on; empty if none."""


@dataclass(frozen=True)
class IpcBucket:
    """One bucket's device buffer, as torch shares a CUDA storage between processes."""

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
    """`sum64` of the bucket (`pipelinerl.weights.cuda_ipc`), computed on the device."""


@dataclass(frozen=True)
class IpcExport:
    """Every bucket of one version, on the GPU named by `device_uuid`."""

    device_uuid: str
    buckets: tuple[IpcBucket, ...]


@dataclass(frozen=True)
class WeightNotice:
    """A new version is ready; receive it by CUDA IPC (if `cuda_ipc` is set), by broadcast (if
    `broadcast` is set) or by fetching."""

    version: WeightVersion
    layout: WeightLayout
    broadcast: Rendezvous | None = None
    cuda_ipc: IpcExport | None = None


@dataclass(frozen=True)
class WeightChunk:
    """Bytes `[offset, offset + len(data))` of one bucket of one version."""

    version: WeightVersion
    bucket: int
    offset: int
    data: bytes
    checksum: Checksum
