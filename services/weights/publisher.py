"""The trainer's side of weight transport: pack each new version into checksummed buckets, tell
every watcher, broadcast the buckets to the current membership, and serve them to `FetchWeights`.

    publish(v, tensors) ──pack (thread)──► latest ──► announce loop
                                                        │ notices: rendezvous for broadcast members,
                                                        │          fetch-only for the others
                                                        ├─► BroadcastGroup(membership).broadcast(bucket…)
    FetchWeights(v) ◄── the last `keep_versions` packed versions, in 4 MiB checksummed chunks
    cuda_ipc: a receiver on the trainer's own GPU gets the version's device buffers as IPC handles
              instead of a rendezvous; they are freed once it calls ReleaseWeights (or a deadline)

Versions published while a broadcast is running are coalesced: receivers only need the newest.
`publish` never waits for a broadcast. A broadcast that fails or times out drops its group;
receivers that missed it fetch instead, so a failure costs time, never correctness. Its version
stays held for `broadcast_timeout_s` after the failure, however many versions were published
meanwhile, so that those fetches find it. The version after a failure goes out fetch-only, and the
one after that forms a new group: a member that died is usually what failed it, and its watch
stream may close a moment later than its socket. A new group is built only once every member has
arrived at its rendezvous (`broadcast.gather`), and is abandoned as soon as a member's stream ends
first, so a member that died between two versions costs the others one fetch, not the timeout. A
member that never arrived at the failed group's rendezvous (it is still watching, but cannot or
will not join) is dropped from broadcast for the rest of its stream: it gets fetch-only notices,
and a reconnect makes it a candidate again.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import WeightVersion
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights import cuda_ipc
from pipelinerl.weights.broadcast import BroadcastGroup, arrived, gather, in_own_thread, tcp_store
from pipelinerl.weights.settings import PublisherSettings
from pipelinerl.weights.types import (
    MAX_CHUNK_BYTES,
    Checksum,
    ChecksumAlgorithm,
    IpcExport,
    Rendezvous,
    WatchRequest,
    WeightChunk,
    WeightLayout,
    WeightNotice,
    crc32,
)

log = get_logger(__name__)


@dataclass
class _DeviceCopy:
    """A version's buckets on the trainer's GPU, exported by CUDA IPC, and who may still read them."""

    buckets: list[torch.Tensor]
    export: IpcExport
    holders: set[str]
    deadline: float


@dataclass
class _Packed:
    version: WeightVersion
    layout: WeightLayout
    buckets: list[torch.Tensor]


@dataclass
class PublisherStats:
    published: int = 0
    broadcasts: int = 0
    failed_broadcasts: int = 0
    last_pack_s: float = 0.0
    last_broadcast_s: float = 0.0
    last_broadcast_gib_per_s: float = 0.0
    rendezvous: int = 0


@dataclass
class _Watcher:
    receiver_id: str
    accepts_broadcast: bool
    serial: int
    cuda_device_uuid: str = ""
    queue: asyncio.Queue[WeightNotice] = field(default_factory=asyncio.Queue)

    @property
    def key(self) -> str:
        """A receiver that reconnected is a new member even under the same id (its old process
        group is gone), so membership is keyed by each stream's registration number too."""
        return f"{self.receiver_id}#{self.serial}"


class WeightPublisher:
    def __init__(self, settings: PublisherSettings, run_id: str, store_host: str = "127.0.0.1") -> None:
        self.settings = settings
        self.run_id = run_id
        """Identifies the trainer run; receivers refuse versions of another run."""
        self.store_host = store_host
        """Address the rendezvous TCPStore binds."""
        self._backend = None if settings.broadcast_backend == "none" else settings.broadcast_backend
        self.stats = PublisherStats()
        self._versions: OrderedDict[int, _Packed] = OrderedDict()
        self._held_until: dict[int, float] = {}
        """Versions held past `keep_versions` (monotonic deadline): one in broadcast, or whose
        broadcast failed lately, so that its members can fetch it."""
        self._latest: _Packed | None = None
        self._announced = -1
        self._watchers: dict[str, _Watcher] = {}
        self._wakeup = asyncio.Event()
        self._store = None
        self._group: BroadcastGroup | None = None
        self._membership: tuple[str, ...] = ()
        self._epoch = 0
        self._fetch_only_next = False
        self._registrations = 0
        self._token = uuid.uuid4().hex[:8]
        self._loop_task: asyncio.Task[None] | None = None
        self._layout_plan: WeightLayout | None = None
        self._device_uuid = ""
        """The trainer's GPU, once a version came from CUDA tensors and `cuda_ipc` is on."""
        self._device_copies: dict[int, _DeviceCopy] = {}
        """Versions whose device buffers some receiver may still read, by version."""

    @property
    def store_port(self) -> int:
        return self._store.port if self._store is not None else 0

    @property
    def latest(self) -> WeightVersion | None:
        """The newest version published (None before the first)."""
        return self._latest.version if self._latest is not None else None

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    async def start(self) -> None:
        if self._backend is not None:
            self._store = await asyncio.to_thread(
                tcp_store,
                self.store_host,
                self.settings.store_port,
                True,
                self.settings.broadcast_timeout_s,
            )
        self._loop_task = asyncio.create_task(self._announce_loop())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        self._leave_group()

    async def publish(
        self, version: int, tensors: Mapping[str, torch.Tensor] | bucketing.TensorSource
    ) -> None:
        """Make `version` available; returns once packed (the broadcast runs in the background)."""
        started = time.perf_counter()
        specs = bucketing.named_specs(tensors)
        if self._layout_plan is None or [t.name for t in self._layout_plan.tensors] != [n for n, _ in specs]:
            self._layout_plan = bucketing.plan_layout(specs, self.settings.bucket_bytes)
        buckets, layout = await asyncio.to_thread(bucketing.pack, tensors, self._layout_plan)
        packed = _Packed(WeightVersion(version, self.run_id), layout, buckets)
        device = specs[0][1].device if specs else torch.device("cpu")
        if self.settings.cuda_ipc and device.type == "cuda":
            self._device_uuid = self._device_uuid or cuda_ipc.device_uuid(device)
            if any(w.cuda_device_uuid == self._device_uuid for w in self._watchers.values()):
                self._device_copies[version] = await asyncio.to_thread(self._device_copy, buckets, device)
        self._versions[version] = packed
        self._drop_old_versions()
        self._latest = packed
        self._free_device_copies()  # after `_latest` moved on: the newest copy is never freed
        self.stats.published += 1
        self.stats.last_pack_s = time.perf_counter() - started
        self._wakeup.set()

    async def watch(self, receiver: WatchRequest) -> AsyncIterator[WeightNotice]:
        """The current version at once (fetch only: the receiver is not in a group yet), then each new one."""
        receiver_id = receiver.receiver_id
        self._registrations += 1
        watcher = _Watcher(
            receiver_id, receiver.accepts_broadcast, self._registrations, receiver.cuda_device_uuid
        )
        self._watchers[receiver_id] = watcher  # a reconnecting receiver replaces its old stream
        try:
            if self._latest is not None:
                yield self._notice(self._latest, watcher)
            while True:
                yield await watcher.queue.get()
        finally:
            if self._watchers.get(receiver_id) is watcher:
                del self._watchers[receiver_id]

    async def fetch(self, version: WeightVersion, buckets: Sequence[int]) -> AsyncIterator[WeightChunk]:
        if version.run_id and version.run_id != self.run_id:
            raise FailedPrecondition(f"run {version.run_id!r} is not this trainer's run {self.run_id!r}")
        packed = self._versions.get(version.version)
        if packed is None:
            held = sorted(self._versions)
            raise FailedPrecondition(f"version {version.version} is not held; held versions: {held}")
        for index in buckets or range(len(packed.buckets)):
            if not 0 <= index < len(packed.buckets):
                raise InvalidArgument.field(
                    "buckets", f"no bucket {index}; version has {len(packed.buckets)}"
                )
            data = packed.buckets[index].numpy()
            for offset in range(0, len(data), MAX_CHUNK_BYTES):
                piece = data[offset : offset + MAX_CHUNK_BYTES].tobytes()
                checksum = Checksum(ChecksumAlgorithm.CRC32, crc32(piece))
                yield WeightChunk(packed.version, index, offset, piece, checksum)

    async def _announce_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            packed = self._latest
            if packed is None or packed.version.version <= self._announced:
                continue
            self._announced = packed.version.version
            await self._announce(packed)

    async def _announce(self, packed: _Packed) -> None:
        members = sorted(
            w.key for w in self._watchers.values() if w.accepts_broadcast and not self._on_device(packed, w)
        )
        if self._store is None or not members or self._fetch_only_next:
            self._fetch_only_next = False
            for watcher in list(self._watchers.values()):
                watcher.queue.put_nowait(self._notice(packed, watcher))
            return
        if tuple(members) != self._membership or self._group is None:
            self._leave_group()
            self._membership, self._epoch = tuple(members), self._epoch + 1
        name = f"{self.run_id}-{self._token}-m{self._epoch}"
        for watcher in list(self._watchers.values()):
            rendezvous = None
            if watcher.key in self._membership:
                rendezvous = self._rendezvous(name, 1 + self._membership.index(watcher.key))
            watcher.queue.put_nowait(self._notice(packed, watcher, rendezvous))
        version = packed.version.version
        self._held_until[version] = math.inf
        try:
            if self._group is None:  # a new group: wait for its members before building it
                timeout_s = self.settings.broadcast_timeout_s
                await gather(self._store, name, self._membership, self._watching, timeout_s)
            await in_own_thread(lambda: self._broadcast(packed, self._rendezvous(name, 0)))
        except Exception as exc:  # a lost receiver or a timeout: next version forms a new group
            self.stats.failed_broadcasts += 1
            self._leave_group()  # at once: a member may still wait on the trainer's connections
            self._fetch_only_next = True
            self._held_until[version] = time.monotonic() + self.settings.broadcast_timeout_s
            log.warning("broadcast failed; receivers will fetch", version=version, error=str(exc))
            await self._drop_absent_members(name)
        else:
            del self._held_until[version]
        self._drop_old_versions()

    def _leave_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    async def _drop_absent_members(self, group_name: str) -> None:
        """Take the members that never arrived at `group_name`'s rendezvous out of broadcast: one
        that watches but cannot join (a port it cannot reach, a wedged process) would otherwise
        fail every group formed with it, each after the full timeout."""
        assert self._store is not None
        store, members = self._store, self._membership
        try:
            present = await asyncio.to_thread(
                lambda: [arrived(store, group_name, r + 1) for r in range(len(members))]
            )
        except Exception as exc:  # the announce loop must outlive a store that fails to answer
            log.warning("could not tell which members joined", error=str(exc))
            return
        absent = {key for key, here in zip(members, present, strict=True) if not here}
        for watcher in self._watchers.values():
            if watcher.key in absent:
                watcher.accepts_broadcast = False
                log.warning("receiver dropped from broadcast: it never joined; it will fetch",
                            receiver=watcher.receiver_id)  # fmt: skip

    def _watching(self, key: str) -> bool:
        """Whether the member `key`'s watch stream is still open."""
        return any(watcher.key == key for watcher in self._watchers.values())

    def _drop_old_versions(self) -> None:
        """Keep the newest `keep_versions`, and any version `_held_until` says is still needed."""
        now = time.monotonic()
        self._held_until = {v: until for v, until in self._held_until.items() if until > now}
        newest = list(self._versions)[-self.settings.keep_versions :]
        for version in [v for v in self._versions if v not in newest and v not in self._held_until]:
            del self._versions[version]

    def release(self, receiver_id: str, version: WeightVersion) -> None:
        """`receiver_id` is done with the device buffers of `version` (ReleaseWeights)."""
        copy = self._device_copies.get(version.version)
        if copy is not None and version.run_id in ("", self.run_id):
            copy.holders.discard(receiver_id)
        self._free_device_copies()

    def _on_device(self, packed: _Packed, watcher: _Watcher) -> bool:
        on_gpu = packed.version.version in self._device_copies
        return on_gpu and watcher.cuda_device_uuid == self._device_uuid

    def _notice(
        self, packed: _Packed, watcher: _Watcher, rendezvous: Rendezvous | None = None
    ) -> WeightNotice:
        """The notice of `packed` for `watcher`: with the device buffers if it shares the GPU."""
        if not self._on_device(packed, watcher):
            return WeightNotice(packed.version, packed.layout, rendezvous)
        copy = self._device_copies[packed.version.version]
        copy.holders.add(watcher.receiver_id)
        return WeightNotice(packed.version, packed.layout, cuda_ipc=copy.export)

    def _device_copy(self, buckets: list[torch.Tensor], device: torch.device) -> _DeviceCopy:
        on_device = [b.to(device) for b in buckets]  # each its own allocation, as export needs
        torch.cuda.synchronize(device)
        deadline = time.monotonic() + self.settings.cuda_ipc_release_s
        return _DeviceCopy(on_device, cuda_ipc.export(on_device), set(), deadline)

    def _free_device_copies(self) -> None:
        """Free the device buffers no receiver holds any more, except the newest version's (a
        receiver may still connect to it); a holder past the deadline is given up on."""
        newest = self._latest.version.version if self._latest is not None else -1
        now = time.monotonic()
        done = [
            v for v, c in self._device_copies.items()
            if v != newest and (not c.holders or now > c.deadline)
        ]  # fmt: skip
        for version in done:
            copy = self._device_copies.pop(version)
            if copy.holders:
                log.warning(
                    "device buffers freed before release", version=version, holders=sorted(copy.holders)
                )
        if done:
            torch.cuda.ipc_collect()  # blocks whose consumers have closed them go back to the allocator

    def _rendezvous(self, name: str, rank: int) -> Rendezvous:
        assert self._backend is not None
        return Rendezvous(
            backend=self._backend,
            host=self.settings.advertise_host,
            port=self.store_port,
            group_name=name,
            world_size=1 + len(self._membership),
            rank=rank,
            timeout_ms=int(self.settings.broadcast_timeout_s * 1000),
        )

    def _broadcast(self, packed: _Packed, rendezvous: Rendezvous) -> None:
        if self._group is None or self._group.name != rendezvous.group_name:
            assert self._store is not None
            self._group = BroadcastGroup(self._store, rendezvous)
            self.stats.rendezvous += 1
        started = time.perf_counter()
        for bucket in packed.buckets:
            self._group.broadcast(bucket.to(self._group.device))
        elapsed = time.perf_counter() - started
        self.stats.broadcasts += 1
        self.stats.last_broadcast_s = elapsed
        self.stats.last_broadcast_gib_per_s = packed.layout.total_bytes / 2**30 / max(elapsed, 1e-9)
        log.info(
            "broadcast",
            version=packed.version.version,
            members=len(self._membership),
            seconds=round(elapsed, 3),
        )
