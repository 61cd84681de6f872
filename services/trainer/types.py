"""What the trainer servicer needs from the trainer core, free of protobuf and grpc."""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pipelinerl.common.errors import ErrorInfo, InvalidArgument
from pipelinerl.common.types import Sample, WeightVersion
from pipelinerl.weights.types import WatchRequest, WeightChunk, WeightNotice

MAX_SAMPLES_PER_MESSAGE = 4096
"""Samples one SubmitSamples message may carry."""


class Disposition(enum.Enum):
    ACCEPTED = "accepted"
    """In the training buffer; a final ack follows."""
    TRAINED = "trained"
    DUPLICATE = "duplicate"
    DROPPED = "dropped"
    REJECTED = "rejected"

    @property
    def final(self) -> bool:
        return self is not Disposition.ACCEPTED


@dataclass(frozen=True)
class SampleAck:
    sample_id: str
    disposition: Disposition
    version: int
    """For TRAINED and DUPLICATE, the version its step produced; otherwise the trainer's version at
    the time."""
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class Malformed:
    """A request entry that is no valid sample: rejected, yet one arrival of its group, so the
    group's other members are not held forever."""

    sample_id: str
    group_id: str
    group_size: int
    error: InvalidArgument


@dataclass(frozen=True)
class TrainerStatus:
    version: WeightVersion
    buffered_samples: int
    trained_samples: int
    dropped_samples: int
    rejected_samples: int
    tokens_per_s: float
    watchers: int
    durable_version: int
    max_lag: int
    """The lag policy's bound (`TrainerSettings.max_lag`)."""


class TrainerCore(Protocol):
    """The trainer as the servicer sees it."""

    async def admit(self, samples: Sequence[Sample | Malformed], on_ack: Callable[[SampleAck], None]) -> None:
        """Take the entries of one request in, in order (errors name their index). `on_ack` is
        called for every ack of these samples, now and later (ACCEPTED, then TRAINED or DROPPED; or
        DUPLICATE or REJECTED at once). May block: that is backpressure."""
        ...

    async def flush(self, checkpoint: bool) -> None:
        """Train what is held even under a step's worth; then checkpoint if asked."""
        ...

    @property
    def durable_version(self) -> int:
        """Every TRAINED ack of a version up to this one survives a crash."""
        ...

    async def wait_durable(self, after: int) -> int:
        """Returns `durable_version` once it exceeds `after` (or the trainer stops)."""
        ...

    def watch(self, receiver: WatchRequest) -> AsyncIterator[WeightNotice]:
        """The current version at once, then every new one."""
        ...

    def fetch(self, version: WeightVersion, buckets: Sequence[int]) -> AsyncIterator[WeightChunk]:
        """Chunks of the given buckets (all if empty); FailedPrecondition if the version is gone."""
        ...

    def release(self, receiver_id: str, version: WeightVersion) -> None:
        """The receiver is done with the CUDA IPC buffers of `version`."""
        ...

    def status(self) -> TrainerStatus: ...
