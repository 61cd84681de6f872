"""Trainer messages <-> trainer domain types, both directions (servicer and client)."""

from __future__ import annotations

from pipelinerl.common import convert
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.status import info_from_status, status_proto
from pipelinerl.trainer.types import Disposition, SampleAck, TrainerStatus
from pipelinerl.trainer.v1 import trainer_pb2 as pb
from pipelinerl.weights import convert as weights_convert
from pipelinerl.weights.types import IpcBucket, IpcExport, Rendezvous, WatchRequest, WeightNotice

_DISPOSITIONS = {
    Disposition.ACCEPTED: pb.DISPOSITION_ACCEPTED,
    Disposition.TRAINED: pb.DISPOSITION_TRAINED,
    Disposition.DUPLICATE: pb.DISPOSITION_DUPLICATE,
    Disposition.DROPPED: pb.DISPOSITION_DROPPED,
    Disposition.REJECTED: pb.DISPOSITION_REJECTED,
}
_DISPOSITION_NAMES = {v: k for k, v in _DISPOSITIONS.items()}


def ack_to_proto(ack: SampleAck) -> pb.SampleAck:
    msg = pb.SampleAck(
        sample_id=ack.sample_id, disposition=_DISPOSITIONS[ack.disposition], version=ack.version
    )
    if ack.error is not None:
        msg.error.CopyFrom(status_proto(ack.error))
    return msg


def ack_from_proto(msg: pb.SampleAck) -> SampleAck:
    if msg.disposition not in _DISPOSITION_NAMES:
        raise InvalidArgument.field("acks.disposition", f"unknown disposition {msg.disposition}")
    error = info_from_status(msg.error) if msg.HasField("error") else None
    return SampleAck(msg.sample_id, _DISPOSITION_NAMES[msg.disposition], msg.version, error)


def notice_to_proto(notice: WeightNotice) -> pb.WatchWeightsResponse:
    msg = pb.WatchWeightsResponse(
        version=convert.version_to_proto(notice.version),
        layout=weights_convert.layout_to_proto(notice.layout),
    )
    if notice.broadcast is not None:
        r = notice.broadcast
        msg.broadcast.CopyFrom(
            pb.BroadcastRendezvous(
                backend=r.backend,
                host=r.host,
                port=r.port,
                group_name=r.group_name,
                world_size=r.world_size,
                rank=r.rank,
                timeout_ms=r.timeout_ms,
            )
        )
    if notice.cuda_ipc is not None:
        msg.cuda_ipc.device_uuid = notice.cuda_ipc.device_uuid
        msg.cuda_ipc.buckets.extend(
            pb.CudaIpcBucket(
                index=b.index,
                num_bytes=b.num_bytes,
                handle=b.handle,
                storage_size_bytes=b.storage_size_bytes,
                storage_offset_bytes=b.storage_offset_bytes,
                ref_counter_handle=b.ref_counter_handle,
                ref_counter_offset=b.ref_counter_offset,
                event_handle=b.event_handle,
                event_sync_required=b.event_sync_required,
                checksum=b.checksum,
            )
            for b in notice.cuda_ipc.buckets
        )
    return msg


def notice_from_proto(msg: pb.WatchWeightsResponse) -> WeightNotice:
    broadcast = None
    if msg.HasField("broadcast"):
        r = msg.broadcast
        broadcast = Rendezvous(r.backend, r.host, r.port, r.group_name, r.world_size, r.rank, r.timeout_ms)
    cuda_ipc = None
    if msg.HasField("cuda_ipc"):
        buckets = tuple(
            IpcBucket(
                b.index,
                b.num_bytes,
                b.handle,
                b.storage_size_bytes,
                b.storage_offset_bytes,
                b.ref_counter_handle,
                b.ref_counter_offset,
                b.event_handle,
                b.event_sync_required,
                b.checksum,
            )
            for b in msg.cuda_ipc.buckets
        )
        cuda_ipc = IpcExport(msg.cuda_ipc.device_uuid, buckets)
    return WeightNotice(
        convert.version_from_proto(msg.version),
        weights_convert.layout_from_proto(msg.layout),
        broadcast,
        cuda_ipc,
    )


def watch_request_to_proto(receiver: WatchRequest) -> pb.WatchWeightsRequest:
    return pb.WatchWeightsRequest(
        receiver_id=receiver.receiver_id,
        current_version=receiver.current_version,
        accepts_broadcast=receiver.accepts_broadcast,
        cuda_device_uuid=receiver.cuda_device_uuid,
    )


def watch_request_from_proto(msg: pb.WatchWeightsRequest) -> WatchRequest:
    if not msg.receiver_id:
        raise InvalidArgument.field("receiver_id", "must not be empty")
    return WatchRequest(msg.receiver_id, msg.current_version, msg.accepts_broadcast, msg.cuda_device_uuid)


def status_to_proto(s: TrainerStatus) -> pb.GetStatusResponse:
    return pb.GetStatusResponse(
        version=convert.version_to_proto(s.version),
        buffered_samples=s.buffered_samples,
        trained_samples=s.trained_samples,
        dropped_samples=s.dropped_samples,
        rejected_samples=s.rejected_samples,
        tokens_per_s=s.tokens_per_s,
        watchers=s.watchers,
        durable_version=s.durable_version,
        max_lag=s.max_lag,
    )


def status_from_proto(msg: pb.GetStatusResponse) -> TrainerStatus:
    return TrainerStatus(
        version=convert.version_from_proto(msg.version),
        buffered_samples=msg.buffered_samples,
        trained_samples=msg.trained_samples,
        dropped_samples=msg.dropped_samples,
        rejected_samples=msg.rejected_samples,
        tokens_per_s=msg.tokens_per_s,
        watchers=msg.watchers,
        durable_version=msg.durable_version,
        max_lag=msg.max_lag,
    )
