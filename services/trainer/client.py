"""Typed asyncio client of the trainer, used by the coordinator, the inference servers and tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from dataclasses import dataclass, replace

import grpc

from pipelinerl.common import convert
from pipelinerl.common.channel import ChannelConfig, ServiceClient
from pipelinerl.common.status import domain_errors
from pipelinerl.common.types import Sample, WeightVersion
from pipelinerl.trainer.convert import (
    ack_from_proto,
    notice_from_proto,
    status_from_proto,
    watch_request_to_proto,
)
from pipelinerl.trainer.types import SampleAck, TrainerStatus
from pipelinerl.trainer.v1 import trainer_pb2 as pb
from pipelinerl.trainer.v1 import trainer_pb2_grpc
from pipelinerl.weights import convert as weights_convert
from pipelinerl.weights.types import WatchRequest, WeightChunk, WeightNotice

RECONNECT_BACKOFF_S = 0.5
"""Longest wait between two attempts to reach a trainer that is down, unless the channel's config
sets one (gRPC's own backoff grows to seconds): a restarted trainer retrains the steps it lost at
once, and no inference server takes a prompt until the coordinator's stream is back and the
server holds the restarted trainer's weights (coordinator/lag_gate.py)."""


@dataclass(frozen=True)
class Flush:
    """Sent in place of a batch: train what is held now, however little; then checkpoint if asked."""

    checkpoint: bool = False


class TrainerClient(ServiceClient):
    """Raises `pipelinerl.common.errors.*` for failed calls (field violations included)."""

    def __init__(self, config: ChannelConfig | str) -> None:
        config = ChannelConfig(config) if isinstance(config, str) else config
        if config.max_reconnect_backoff_s is None:
            config = replace(config, max_reconnect_backoff_s=RECONNECT_BACKOFF_S)
        super().__init__(config)
        self._stub = trainer_pb2_grpc.TrainerServiceStub(self._channel)

    async def submit(self, batches: AsyncIterable[Sequence[Sample]]) -> AsyncIterator[SampleAck]:
        """Send batches of samples; yields every ack until all accepted samples have a final one."""
        async for acks, _ in self.submit_durably(batches):
            for ack in acks:
                yield ack

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        """Send batches of samples (or a `Flush`); yields each response's acks with the trainer's
        `durable_version` at that point.

        `batches` is read only while the stream is open: once it ends, broken or done, a batch
        being awaited is cancelled, not taken. (A request iterator handed to gRPC would outlive a
        call that fails on its own, and take the next batch of a source that a new stream reads.)"""
        call = self._stub.SubmitSamples()
        writer = asyncio.create_task(_write_all(call, batches))
        try:
            with domain_errors():
                async for response in call:
                    yield [ack_from_proto(ack) for ack in response.acks], response.durable_version
        finally:
            writer.cancel()
            call.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            if not writer.cancelled() and (error := writer.exception()) is not None:
                raise error  # `batches` itself failed: the call was cancelled for it

    async def watch_weights(self, receiver: WatchRequest) -> AsyncIterator[WeightNotice]:
        """The current version at once, then each new one. While the trainer is unreachable the call
        waits for it instead of failing, so a watcher follows a restarted trainer as soon as the
        channel connects again (its reconnect backoff bounds how soon)."""
        request = watch_request_to_proto(receiver)
        with domain_errors():
            async for notice in self._stub.WatchWeights(request, wait_for_ready=True):
                yield notice_from_proto(notice)

    async def fetch_weights(
        self, version: WeightVersion, buckets: Sequence[int] = (), timeout_s: float | None = None
    ) -> AsyncIterator[WeightChunk]:
        request = pb.FetchWeightsRequest(version=convert.version_to_proto(version), buckets=buckets)
        with domain_errors():
            async for response in self._stub.FetchWeights(request, timeout=timeout_s):
                yield weights_convert.chunk_from_proto(response.chunk)

    async def release_weights(self, receiver_id: str, version: WeightVersion) -> None:
        request = pb.ReleaseWeightsRequest(receiver_id=receiver_id, version=convert.version_to_proto(version))
        with domain_errors():
            await self._stub.ReleaseWeights(request)

    async def status(self, timeout_s: float | None = None) -> TrainerStatus:
        with domain_errors():
            return status_from_proto(await self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s))


async def _write_all(
    call: grpc.aio.StreamStreamCall, batches: AsyncIterable[Sequence[Sample] | Flush]
) -> None:
    """Write every batch on `call`, then half-close it. Returns quietly when the call has ended (its
    reader reports why); cancels the call if `batches` raises."""
    try:
        async for batch in batches:
            if isinstance(batch, Flush):
                await call.write(pb.SubmitSamplesRequest(flush=True, checkpoint=batch.checkpoint))
            else:
                await call.write(pb.SubmitSamplesRequest(samples=[convert.sample_to_proto(s) for s in batch]))
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        return
    except Exception:
        call.cancel()
        raise
