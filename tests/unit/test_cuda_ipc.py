"""CUDA IPC hand-off, the parts that hold without a GPU: the device checksum catches what a
transport error would do, the notice survives the wire, and a receiver that cannot open the
handles fetches the version instead and still releases the trainer's buffers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from pipelinerl.common.types import WeightVersion
from pipelinerl.trainer.convert import (
    notice_from_proto,
    notice_to_proto,
    watch_request_from_proto,
    watch_request_to_proto,
)
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights import publisher as publishing
from pipelinerl.weights.cuda_ipc import sum64
from pipelinerl.weights.receiver import WeightReceiver
from pipelinerl.weights.types import (
    MAX_CHUNK_BYTES,
    Checksum,
    ChecksumAlgorithm,
    IpcBucket,
    IpcExport,
    WatchRequest,
    WeightChunk,
    WeightLayout,
    WeightNotice,
    crc32,
)

WEIGHTS = {"a.weight": torch.arange(12.0).view(3, 4), "b.bias": torch.ones(5)}


def test_sum64_sees_a_flipped_bit_swapped_words_and_the_tail() -> None:
    data = torch.randint(
        0, 256, (8 * 1000 + 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    reference = sum64(data)
    assert sum64(data.clone()) == reference and len(reference) == 8
    flipped = data.clone()
    flipped[4321] ^= 0x10
    swapped = data.clone()
    swapped[0:8], swapped[8:16] = data[8:16].clone(), data[0:8].clone()
    tail = data.clone()
    tail[-1] ^= 1
    assert len({reference, sum64(flipped), sum64(swapped), sum64(tail)}) == 4


def ipc_export() -> IpcExport:
    bucket = IpcBucket(0, 96, b"h" * 64, 512, 0, b"/torch_1_2", 8, b"e" * 64, True, b"\x01" * 8)
    return IpcExport("GPU-1234", (bucket,))


def test_a_cuda_ipc_notice_and_request_survive_the_wire() -> None:
    layout = bucketing.plan_layout(WEIGHTS.items())
    notice = WeightNotice(WeightVersion(3, "run"), layout, cuda_ipc=ipc_export())
    assert notice_from_proto(notice_to_proto(notice)) == notice
    request = WatchRequest("inference-0", 2, True, "GPU-1234")
    assert watch_request_from_proto(watch_request_to_proto(request)) == request


class OneVersion:
    """A trainer holding one version, announced with device handles no process here can open."""

    def __init__(self) -> None:
        self.layout: WeightLayout
        buckets, self.layout = bucketing.pack(WEIGHTS, bucketing.plan_layout(WEIGHTS.items()))
        self.bucket = buckets[0]
        self.released: list[tuple[str, int]] = []

    async def watch_weights(self, request: WatchRequest, /) -> AsyncIterator[WeightNotice]:
        assert request.cuda_device_uuid == ""  # no GPU here, so the receiver offers none
        yield WeightNotice(WeightVersion(1, "run"), self.layout, cuda_ipc=ipc_export())

    async def fetch_weights(
        self, version: WeightVersion, buckets: Sequence[int], /
    ) -> AsyncIterator[WeightChunk]:
        data = self.bucket.numpy().tobytes()
        for offset in range(0, len(data), MAX_CHUNK_BYTES):
            piece = data[offset : offset + MAX_CHUNK_BYTES]
            yield WeightChunk(version, 0, offset, piece, Checksum(ChecksumAlgorithm.CRC32, crc32(piece)))

    async def release_weights(self, receiver_id: str, version: WeightVersion, /) -> None:
        self.released.append((receiver_id, version.version))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path of a receiver without a GPU")
async def test_a_receiver_that_cannot_open_the_handles_fetches_and_releases() -> None:
    source = OneVersion()
    applied: dict[str, torch.Tensor] = {}

    async def apply(version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]) -> None:
        applied.update({k: v.clone() for k, v in bucketing.unpack(layout, buckets).items()})

    receiver = WeightReceiver(source, "inference-0", apply)
    notice = await anext(source.watch_weights(WatchRequest("inference-0", -1, True)))
    assert await receiver.receive(notice)
    assert receiver.version == WeightVersion(1, "run")
    assert all(torch.equal(applied[k], WEIGHTS[k]) for k in WEIGHTS)
    assert (receiver.stats.cuda_ipc, receiver.stats.fetches) == (0, 1)
    assert "cuda_ipc" in receiver.stats.last_error and "no GPU" in receiver.stats.last_error
    assert source.released == [("inference-0", 1)]


def test_the_trainer_frees_a_versions_device_buffers_once_released_or_overdue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Bookkeeping only (no GPU here): held while a receiver has them open, freed on release, never
    the newest version's, and given up on after the deadline."""
    monkeypatch.setattr(torch.cuda, "ipc_collect", lambda: None)
    publisher = publishing.WeightPublisher(publishing.PublisherSettings(), run_id="run")

    def hand_out(version: int, holders: set[str], deadline: float = float("inf")) -> None:
        copy = publishing._DeviceCopy([torch.zeros(1)], ipc_export(), set(holders), deadline)
        publisher._device_copies[version] = copy
        buckets, layout = bucketing.pack(WEIGHTS, bucketing.plan_layout(WEIGHTS.items()))
        packed = publishing._Packed(WeightVersion(version, "run"), layout, buckets)
        publisher._versions[version] = packed
        publisher._latest = packed

    hand_out(1, {"a", "b"})
    hand_out(2, {"a"})
    publisher._free_device_copies()
    assert set(publisher._device_copies) == {1, 2}  # 1 is held by both receivers
    publisher.release("a", WeightVersion(1, "run"))
    publisher.release("b", WeightVersion(1, "run"))
    assert set(publisher._device_copies) == {2}
    on_the_gpu = publishing._Watcher("c", True, 1, ipc_export().device_uuid)
    publisher._device_uuid = on_the_gpu.cuda_device_uuid
    assert publisher._notice(publisher._versions[1], on_the_gpu).cuda_ipc is None  # freed: fetch it
    hand_out(3, set(), deadline=0.0)  # the newest: kept although nobody holds it and it is overdue
    publisher.release("a", WeightVersion(2, "run"))
    assert set(publisher._device_copies) == {3}
    publisher._device_copies[2] = publishing._DeviceCopy([], ipc_export(), {"gone"}, deadline=0.0)
    publisher._free_device_copies()
    assert set(publisher._device_copies) == {3}  # a receiver that never released is given up on
