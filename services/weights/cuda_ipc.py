"""Same-GPU hand-off of a version by CUDA IPC: the trainer exports each bucket's device buffer as
an IPC handle, an inference server on the same GPU opens it, checks it and copies it out.

    trainer: pack on its GPU ──export──► IpcExport (device UUID, one handle + checksum per bucket)
    inference (same GPU):  open ──verify (on the device)──► ApplyWeights ──► close, ReleaseWeights

NCCL cannot put two ranks of one group on one GPU, and one GPU box is where most runs start: there
the trainer and the inference server share the device, and a version moves as one device-to-device
copy per bucket, with no host round trip. The handles are torch's own (`UntypedStorage._share_cuda_`),
so the producer's caching allocator keeps a buffer alive while a consumer holds it open.

The CRC-32 of the layout is computed on host bytes; a device buffer is checked with `sum64`, a
position-weighted sum computed on the device, which catches a buffer overwritten or a handle
opened on the wrong allocation.
"""

from __future__ import annotations

import torch

from pipelinerl.common.errors import FailedPrecondition
from pipelinerl.weights.types import IpcBucket, IpcExport

_CHUNK_WORDS = 1 << 24  # 128 MiB of int64 products at a time, whatever the bucket's size


def device_uuid(device: torch.device | str) -> str:
    """The GPU's UUID: the same physical device, whatever CUDA_VISIBLE_DEVICES numbers it."""
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def local_device(uuid: str) -> torch.device:
    """This process's index of the GPU `uuid`; FailedPrecondition if it cannot see that GPU."""
    seen = [device_uuid(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise FailedPrecondition(
            f"cuda_ipc needs the trainer's GPU {uuid} on this host; this process sees {seen or 'no GPU'}"
        )
    return torch.device("cuda", seen.index(uuid))


def sum64(bucket: torch.Tensor) -> bytes:
    """Sum of the bucket's 8-byte words times odd position weights, modulo 2**64 (integer wrap is
    order-free, so every device and reduction order gives the same value); the tail bytes count
    one by one."""
    flat = bucket.reshape(-1)
    words = flat.numel() // 8
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    body = flat[: words * 8].view(torch.int64)
    for start in range(0, words, _CHUNK_WORDS):
        part = body[start : start + _CHUNK_WORDS]
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=flat.device) * 2 + 1
        total += (part * weights).sum()
    tail = flat[words * 8 :].to(torch.int64)
    total += (tail * (torch.arange(tail.numel(), dtype=torch.int64, device=flat.device) + 1)).sum()
    return int(total.item()).to_bytes(8, "big", signed=True)


def export(buckets: list[torch.Tensor]) -> IpcExport:
    """Handles of the CUDA uint8 `buckets` (each a whole tensor of its own storage). The caller
    keeps the buckets alive until every receiver has released them."""
    if not buckets:
        raise ValueError("nothing to export")
    device = buckets[0].device
    exported = []
    for index, bucket in enumerate(buckets):
        if bucket.device != device or bucket.dtype != torch.uint8 or bucket.storage_offset() != 0:
            raise ValueError(f"bucket {index}: not a uint8 tensor at the start of a storage on {device}")
        storage = bucket.untyped_storage()
        _, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
        exported.append(
            IpcBucket(
                index, bucket.numel(), handle, size, offset, counter, counter_offset, event, event_sync,
                sum64(bucket),
            )
        )  # fmt: skip
    return IpcExport(device_uuid(device), tuple(exported))


def open_buckets(exported: IpcExport) -> list[torch.Tensor]:
    """The trainer's buckets, opened in this process (another process: CUDA refuses to open a
    handle in the one that made it) and verified on the device. FailedPrecondition if the GPU is
    not this host's or a bucket's checksum differs. Drop the tensors to release the handles."""
    device = local_device(exported.device_uuid)
    opened = []
    for b in exported.buckets:
        storage = torch.UntypedStorage._new_shared_cuda(
            device.index, b.handle, b.storage_size_bytes, b.storage_offset_bytes,
            b.ref_counter_handle, b.ref_counter_offset, b.event_handle, b.event_sync_required,
        )  # fmt: skip
        bucket = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)[: b.num_bytes]
        if bucket.numel() != b.num_bytes or sum64(bucket) != b.checksum:
            raise FailedPrecondition(f"bucket {b.index}: checksum mismatch on the device")
        opened.append(bucket)
    return opened
