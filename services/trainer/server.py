"""gRPC servicer of the trainer: proto <-> domain conversion around a `TrainerCore`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pipelinerl.common import convert
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.server import Registration
from pipelinerl.common.types import Sample
from pipelinerl.trainer.convert import (
    ack_to_proto,
    notice_to_proto,
    status_to_proto,
    watch_request_from_proto,
)
from pipelinerl.trainer.types import MAX_SAMPLES_PER_MESSAGE, Disposition, Malformed, SampleAck, TrainerCore
from pipelinerl.trainer.v1 import trainer_pb2 as pb
from pipelinerl.trainer.v1 import trainer_pb2_grpc
from pipelinerl.weights import convert as weights_convert


class TrainerServicer(trainer_pb2_grpc.TrainerServiceServicer):
    def __init__(self, core: TrainerCore) -> None:
        self._core = core

    async def SubmitSamples(
        self, request_iterator: AsyncIterator[pb.SubmitSamplesRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.SubmitSamplesResponse]:
        # The stream stays open after the client half-closes until every accepted sample has its
        # final ack, so a client can send, close, and read acks to the end. An int in the queue is
        # a new durable version, sent on its own so that a client hears of every checkpoint.
        acks: asyncio.Queue[SampleAck | int | None] = asyncio.Queue()
        reader = asyncio.create_task(self._read_samples(request_iterator, acks))
        durable = asyncio.create_task(self._watch_durable(acks))
        pending: set[str] = set()
        reading = True
        try:
            while reading or pending:
                batch = [await acks.get()]
                while not acks.empty():
                    batch.append(acks.get_nowait())
                out = []
                checkpointed = False
                for ack in batch:
                    if isinstance(ack, int):
                        checkpointed = True
                        continue
                    if ack is None:
                        reading = False
                        await asyncio.wait([reader])
                        reader.result()  # re-raises a malformed-request error of the reader
                        continue
                    if ack.disposition is Disposition.ACCEPTED:
                        pending.add(ack.sample_id)
                    else:
                        pending.discard(ack.sample_id)
                    out.append(ack_to_proto(ack))
                if out or checkpointed:
                    yield pb.SubmitSamplesResponse(acks=out, durable_version=self._core.durable_version)
        finally:
            reader.cancel()
            durable.cancel()

    async def _watch_durable(self, acks: asyncio.Queue[SampleAck | int | None]) -> None:
        durable = self._core.durable_version
        while (newer := await self._core.wait_durable(durable)) > durable:  # equal: stopping
            durable = newer
            acks.put_nowait(durable)

    async def _read_samples(
        self,
        request_iterator: AsyncIterator[pb.SubmitSamplesRequest],
        acks: asyncio.Queue[SampleAck | int | None],
    ) -> None:
        try:
            async for request in request_iterator:
                if len(request.samples) > MAX_SAMPLES_PER_MESSAGE:
                    raise InvalidArgument.field("samples", f"at most {MAX_SAMPLES_PER_MESSAGE} per message")
                entries: list[Sample | Malformed] = []
                for i, msg in enumerate(request.samples):
                    try:
                        entries.append(convert.sample_from_proto(msg, f"samples[{i}]"))
                    except InvalidArgument as exc:
                        entries.append(Malformed(msg.sample_id, msg.group_id, msg.group_size, exc))
                if entries:
                    await self._core.admit(entries, acks.put_nowait)
                if request.flush or request.checkpoint:
                    await self._core.flush(checkpoint=request.checkpoint)
        finally:
            acks.put_nowait(None)

    async def WatchWeights(
        self, request: pb.WatchWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchWeightsResponse]:
        async for notice in self._core.watch(watch_request_from_proto(request)):
            yield notice_to_proto(notice)

    async def FetchWeights(
        self, request: pb.FetchWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FetchWeightsResponse]:
        if request.version.version < 0:
            raise InvalidArgument.field("version.version", "must be >= 0")
        version = convert.version_from_proto(request.version)
        async for chunk in self._core.fetch(version, list(request.buckets)):
            yield pb.FetchWeightsResponse(chunk=weights_convert.chunk_to_proto(chunk))

    async def ReleaseWeights(
        self, request: pb.ReleaseWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReleaseWeightsResponse:
        if not request.receiver_id:
            raise InvalidArgument.field("receiver_id", "must not be empty")
        self._core.release(request.receiver_id, convert.version_from_proto(request.version))
        return pb.ReleaseWeightsResponse()

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        return status_to_proto(self._core.status())


def registration(core: TrainerCore) -> Registration:
    return Registration(
        pb.DESCRIPTOR.services_by_name["TrainerService"].full_name,
        lambda server: trainer_pb2_grpc.add_TrainerServiceServicer_to_server(TrainerServicer(core), server),
    )
