"""The inference server's side of weight transport: follow the trainer's versions and hand each
verified version to the engine.

    WatchWeights ──notice──► broadcast (if a rendezvous is given) ──► verify every bucket
                │                │ failed / timed out / bad checksum          │ all good
                │                ▼                                            ▼
                │        FetchWeights(bad buckets) ──verify──────────► apply(version, layout, buckets)
                │                ▲ refused (other GPU, bad checksum)          ▲
                └─ cuda_ipc ─────┴── open the trainer's device buffers ──────┘ then ReleaseWeights

Nothing reaches the engine before every bucket of a version has passed its checksum, so a server
never serves a mix of two versions: a failed transfer leaves the old weights, is counted, and is
retried by fetching.

The stream is read ahead of the versions being received. A broadcast relays through the receivers
(gloo's is a tree), so one whose peer died mid-broadcast can wait on it after the trainer's own part
has ended, up to the group's timeout. Once the trainer announces a version outside that group (it
forms a new one when a member leaves), nothing more can come of it: the receiver gives it up and
takes the newer version, instead of holding the new group's rendezvous, and with it every other
member, until the timeout.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pipelinerl.common.errors import FailedPrecondition, PipelineError, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import WeightVersion
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights import cuda_ipc
from pipelinerl.weights.broadcast import BroadcastGroup, in_own_thread, join
from pipelinerl.weights.types import Rendezvous, WatchRequest, WeightChunk, WeightLayout, WeightNotice, crc32

log = get_logger(__name__)

ApplyWeights = Callable[[WeightVersion, WeightLayout, list[torch.Tensor]], Awaitable[None]]
"""The engine-facing seam: load a version given as its verified buckets and their layout. Returns
only once the engine has copied the version out (into the model, or into a staging copy while
requests pinned to the version it holds run): the buckets' memory is reused for the next one.
Raises PipelineError (old weights kept) if the engine refuses the version."""


class WeightSource(Protocol):
    """What the receiver needs of the trainer: its gRPC client, `TrainerClient`. Arguments are
    passed by position."""

    def watch_weights(self, request: WatchRequest, /) -> AsyncIterator[WeightNotice]: ...

    def fetch_weights(
        self, version: WeightVersion, buckets: Sequence[int], /
    ) -> AsyncIterator[WeightChunk]: ...

    async def release_weights(self, receiver_id: str, version: WeightVersion, /) -> None: ...


class VersionGone(FailedPrecondition):
    """The trainer refused to send a version: it moved past it, or restarted since announcing it."""


@dataclass
class ReceiverStats:
    updates: int = 0
    failed_updates: int = 0
    broadcasts: int = 0
    abandoned_broadcasts: int = 0
    """Broadcasts given up because the trainer had moved on to another group (their version
    skipped for the newer one)."""
    fetches: int = 0
    cuda_ipc: int = 0
    fetch_fallbacks: int = 0
    """Versions fetched because their broadcast or CUDA IPC hand-off failed or was corrupt."""
    verification_failures: int = 0
    """Buckets or chunks received with a wrong checksum (then fetched again)."""
    last_receive_s: float = 0.0
    last_error: str = ""


class WeightReceiver:
    def __init__(
        self,
        source: WeightSource,
        receiver_id: str,
        apply: ApplyWeights,
        *,
        accepts_broadcast: bool = True,
        cuda_device: torch.device | None = None,
        fetch_attempts: int = 3,
        reconnect_s: float = 1.0,
        on_update: Callable[[float], None] | None = None,
    ) -> None:
        """`cuda_device`: the GPU the engine runs on, if it accepts versions by CUDA IPC from a
        trainer on the same GPU. `on_update(seconds)` is called after each version is applied, with
        the time from its notice until the engine took it (its swap, or its staging)."""
        self._source = source
        self._receiver_id = receiver_id
        self._apply = apply
        self._accepts_broadcast = accepts_broadcast
        self._cuda_uuid = cuda_ipc.device_uuid(cuda_device) if cuda_device is not None else ""
        self._fetch_attempts = fetch_attempts
        self._reconnect_s = reconnect_s
        self._on_update = on_update
        self._group: BroadcastGroup | None = None
        self._group_lock = threading.Lock()
        self._calls = 0
        """Broadcast calls begun or given up; a call whose number is no longer this one may not
        take `_group` (one given up while it joined its group would take the place of a newer)."""
        self._buckets: list[torch.Tensor] = []
        self._reading = False
        self._newest_group: str | None = None
        """While the stream is read (`run`), the group of the newest notice read (None: a notice
        without one)."""
        self._notice_read = asyncio.Event()
        self.version: WeightVersion | None = None
        self.stats = ReceiverStats()

    async def run(self) -> None:
        """Follow the trainer until cancelled. The stream is reopened when it drops, or when no
        trainer answered a fetch (its end may not have been seen yet): at once if it had announced
        a version (a restarted trainer announces its newest on the new one), else after
        `reconnect_s`. `TrainerClient.watch_weights` waits while the trainer is unreachable, so the
        new stream opens once the channel reaches the trainer again (within its reconnect backoff)."""
        while True:
            announced = False
            current = -1 if self.version is None else self.version.version
            request = WatchRequest(self._receiver_id, current, self._accepts_broadcast, self._cuda_uuid)
            notices: asyncio.Queue[WeightNotice | Exception | None] = asyncio.Queue()
            reader = asyncio.create_task(self._read(request, notices))
            try:
                while (notice := await notices.get()) is not None:
                    if isinstance(notice, Exception):
                        raise notice
                    announced = True
                    await self.receive(notice)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the trainer restarting or unreachable: keep serving, retry
                log.warning("weight stream lost; reconnecting", error=str(exc), retry_s=self._reconnect_s)
            finally:
                reader.cancel()
            if not announced:
                await asyncio.sleep(self._reconnect_s)

    async def _read(
        self, request: WatchRequest, notices: asyncio.Queue[WeightNotice | Exception | None]
    ) -> None:
        """Queue the stream's notices as they come (then None, or the error that ended it), noting
        the group of the newest for `_receive_broadcast`."""
        self._reading = True
        try:
            async for notice in self._source.watch_weights(request):
                self._newest_group = notice.broadcast.group_name if notice.broadcast is not None else None
                self._notice_read.set()
                notices.put_nowait(notice)
        except Exception as exc:
            notices.put_nowait(exc)
            return
        finally:
            self._reading = False
        notices.put_nowait(None)

    async def receive(self, notice: WeightNotice) -> bool:
        """Receive, verify and apply one version. False (old weights kept) if it could not be had.
        Raises Unavailable (old weights kept, the update counted as failed) if no trainer answered
        its fetch: the version may have died with its trainer, and the stream with it."""
        started = time.perf_counter()
        layout = notice.layout
        held = (
            self.version is not None
            and notice.version.version <= self.version.version
            and self.version.run_id == notice.version.run_id
        )
        if notice.cuda_ipc is not None:  # never with a rendezvous: the host buffers wait for a fetch
            applied = not held and await self._receive_on_device(notice)
            await self._release(notice.version)
            if applied:
                self._updated(notice.version, "cuda_ipc", started)
                return True
        buckets = self._buckets_for(layout)
        missing = list(range(len(buckets)))
        if notice.broadcast is not None:
            # Joining the broadcast is owed to the group even for a version we would skip.
            received = await self._receive_broadcast(notice.broadcast, layout, buckets)
            if received is None:  # given up: the trainer has moved on to a newer version
                return False
            missing = received
        if held:
            return True
        if missing and (notice.broadcast is not None or notice.cuda_ipc is not None):
            self.stats.fetch_fallbacks += 1
        try:
            if missing:
                await self._fetch(notice.version, layout, buckets, missing)
        except VersionGone as exc:  # superseded, not failed: the next notice names a held version
            log.warning("version no longer held; keeping the old weights", version=notice.version.version,
                        error=exc.message)  # fmt: skip
            return False
        except PipelineError as exc:
            self._fail(notice.version, exc.message)
            if isinstance(exc, Unavailable):
                raise
            return False
        try:
            await self._apply(notice.version, layout, buckets)
        except PipelineError as exc:  # e.g. a layout that does not fit the served model
            self._fail(notice.version, exc.message)
            return False
        self._updated(notice.version, "fetch" if missing else "broadcast", started)
        return True

    def _updated(self, version: WeightVersion, via: str, started: float) -> None:
        self.version = version
        self.stats.updates += 1
        self.stats.last_receive_s = time.perf_counter() - started
        seconds = round(self.stats.last_receive_s, 3)
        log.info("weights updated", version=version.version, via=via, seconds=seconds)
        if self._on_update is not None:
            self._on_update(self.stats.last_receive_s)

    async def _receive_on_device(self, notice: WeightNotice) -> bool:
        """Apply the version straight from the trainer's device buffers; False (fetch instead) if
        they cannot be opened here or fail their checksum."""
        assert notice.cuda_ipc is not None
        try:
            opened = cuda_ipc.open_buckets(notice.cuda_ipc)
            sizes, got = [b.num_bytes for b in notice.layout.buckets], [b.numel() for b in opened]
            if got != sizes:
                raise FailedPrecondition(f"device buckets of {got} bytes, expected {sizes}")
            await self._apply(notice.version, notice.layout, opened)
        except PipelineError as exc:
            self.stats.last_error = f"cuda_ipc: {exc.message}"
            log.warning("cuda_ipc hand-off refused; fetching instead", version=notice.version.version,
                        error=exc.message)  # fmt: skip
            return False
        self.stats.cuda_ipc += 1
        return True

    async def _release(self, version: WeightVersion) -> None:
        """Tell the trainer it may free the device buffers (the handles are closed: the opened
        tensors are gone once `_receive_on_device` returned)."""
        try:
            await self._source.release_weights(self._receiver_id, version)
        except PipelineError as exc:  # the trainer frees them after its deadline anyway
            log.warning("release of device buffers failed", version=version.version, error=exc.message)

    def _buckets_for(self, layout: WeightLayout) -> list[torch.Tensor]:
        """Receive buffers, reused from version to version while the layout's sizes hold: fresh
        memory would page-fault on every write and halve the transfer rate. Reuse is safe because
        `apply` returns only once the engine has copied a version out of them."""
        sizes = [b.num_bytes for b in layout.buckets]
        if [b.numel() for b in self._buckets] != sizes:
            self._buckets = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        return self._buckets

    def _fail(self, version: WeightVersion, reason: str) -> None:
        self.stats.failed_updates += 1
        self.stats.last_error = reason
        log.error("weight update failed; keeping the old weights", version=version.version, error=reason)

    async def _receive_broadcast(
        self, rendezvous: Rendezvous, layout: WeightLayout, buckets: list[torch.Tensor]
    ) -> list[int] | None:
        """Receive every bucket by broadcast; returns the indices that must still be fetched, or
        None if the broadcast was given up because the trainer announced a version outside its
        group meanwhile."""
        with self._group_lock:
            self._calls += 1
            call = self._calls
        broadcast = asyncio.ensure_future(in_own_thread(lambda: self._broadcast(rendezvous, buckets, call)))
        broadcast.add_done_callback(lambda done: done.cancelled() or done.exception())  # read below
        moved_on = asyncio.ensure_future(self._moved_on_from(rendezvous.group_name))
        try:
            await asyncio.wait((broadcast, moved_on), return_when=asyncio.FIRST_COMPLETED)
        finally:
            moved_on.cancel()
        if not broadcast.done():
            with self._group_lock:
                self._calls += 1
                self._leave_group()
            self._buckets = []  # left waiting to its own timeout, the call may still write into them
            self.stats.abandoned_broadcasts += 1
            log.warning("broadcast given up: the trainer has moved on to another group",
                        group=rendezvous.group_name, newest=self._newest_group)  # fmt: skip
            return None
        try:
            broadcast.result()
        except Exception as exc:
            self._leave_group()  # at once: the trainer or a peer may still wait on its connections
            self.stats.last_error = f"broadcast: {exc}"
            log.warning("broadcast failed; fetching instead", error=str(exc))
            return list(range(len(buckets)))
        self.stats.broadcasts += 1
        bad = []
        for index, bucket in enumerate(buckets):
            try:
                bucketing.verify(layout, index, bucket)
            except FailedPrecondition as exc:
                log.warning("broadcast bucket corrupt; fetching it", bucket=index, error=exc.message)
                self.stats.verification_failures += 1
                bad.append(index)
        return bad

    async def _moved_on_from(self, group: str) -> None:
        """Return once a notice of another group, or of none, has been read from the stream (never
        when `receive` is called on its own)."""
        while not self._reading or self._newest_group == group:
            self._notice_read.clear()
            await self._notice_read.wait()

    def _broadcast(self, rendezvous: Rendezvous, buckets: list[torch.Tensor], call: int) -> None:
        """Call `call`'s broadcast, in its own thread: on the receiver's group if it is the one
        named, else on a group joined for it. The group is held here, not read from `_group` again:
        a call given up may outlive its group's place there."""
        with self._group_lock:
            group = self._group
            if group is not None and group.name != rendezvous.group_name:
                self._leave_group()
                group = None
        if group is None:
            group = join(rendezvous)
            with self._group_lock:
                if call != self._calls:  # given up while it joined
                    group.close()
                    raise RuntimeError(f"the broadcast of group {rendezvous.group_name} was given up")
                self._group = group
        device = group.device
        for bucket in buckets:
            staged = bucket if device.type == "cpu" else bucket.to(device)
            group.broadcast(staged)
            if staged is not bucket:
                bucket.copy_(staged)

    def _leave_group(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    async def _fetch(
        self, version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor], wanted: list[int]
    ) -> None:
        last_error: PipelineError | None = None
        for attempt in range(self._fetch_attempts):
            try:
                await self._fetch_once(version, layout, buckets, wanted)
                self.stats.fetches += 1
                return
            except (VersionGone, Unavailable):
                raise  # asking again cannot help: a newer notice (or stream) brings a held version
            except PipelineError as exc:
                last_error = exc
                if isinstance(exc, FailedPrecondition):  # a chunk or bucket failed its check
                    self.stats.verification_failures += 1
                log.warning("fetch failed", version=version.version, attempt=attempt + 1, error=exc.message)
                await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
        assert last_error is not None
        raise last_error

    async def _fetch_once(
        self, version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor], wanted: list[int]
    ) -> None:
        async for chunk in self._chunks(version, wanted):
            if chunk.bucket not in wanted:
                raise FailedPrecondition(f"chunk of bucket {chunk.bucket}, which was not asked for")
            if crc32(chunk.data) != chunk.checksum.value:
                raise FailedPrecondition(
                    f"chunk at bucket {chunk.bucket} offset {chunk.offset}: checksum mismatch"
                )
            end = chunk.offset + len(chunk.data)
            if end > buckets[chunk.bucket].numel():
                raise FailedPrecondition(f"chunk past the end of bucket {chunk.bucket}")
            buckets[chunk.bucket][chunk.offset : end].copy_(
                torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
            )
        for index in wanted:
            bucketing.verify(layout, index, buckets[index])

    async def _chunks(self, version: WeightVersion, wanted: list[int]) -> AsyncIterator[WeightChunk]:
        """The trainer's chunks of `version`; its FAILED_PRECONDITION (a version it no longer holds,
        or of another run) as `VersionGone`."""
        try:
            async for chunk in self._source.fetch_weights(version, wanted):
                yield chunk
        except FailedPrecondition as exc:
            raise VersionGone(exc.message) from exc
