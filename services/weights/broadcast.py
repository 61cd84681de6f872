"""Broadcast groups of their own, one per membership, outside torch.distributed's global world.

Inference servers come and go while the trainer runs, so the trainer cannot hold one fixed
`init_process_group` world. Like vLLM's stateless process group, each membership (the set of
receivers present when a version is published) gets a process group object built directly on a
`PrefixStore(group_name, TCPStore)`; the trainer hosts the TCPStore and is rank 0. A new membership
means a new group name and a new rendezvous; the old group is dropped.

A rendezvous has two steps. Each receiver marks its arrival in the store and waits for the
trainer's word; the trainer (`gather`) waits until every member has arrived, then says go, and only
then does each rank build the process group. A member that will never arrive (its process died
before its watch stream's end was seen, or it cannot reach the store) makes the trainer abandon the
group as soon as its stream ends, or at the timeout: the others hear so at once and fetch, where a
process group's own rendezvous would have held every one of them until the timeout.

Blocking calls (rendezvous, broadcast) run in threads of their own (`in_own_thread`); gloo and NCCL
release the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported without `as`
from torch.distributed.distributed_c10d import PrefixStore, Store

from pipelinerl.weights.types import Rendezvous

T = TypeVar("T")

GATHER_POLL_S = 0.005
"""How often the trainer looks for arrivals while a new group gathers."""


async def in_own_thread(call: Callable[[], T]) -> T:
    """`call()`, a rendezvous or a broadcast, in a daemon thread of its own. Such a call waits for
    every rank, up to the group's timeout (a minute by default) when a peer is gone; in
    `asyncio.to_thread`'s pool the process would wait for it at exit, past the grace period of a
    SIGTERM (then killed), where a daemon thread is left behind. Cancelling the await leaves the
    call running to its own end, as with `to_thread`."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.cancelled():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # pyright: ignore[reportArgumentType]  # None only with an error

    def run() -> None:
        result, error = None, None
        try:
            result = context.run(call)
        except BaseException as exc:  # handed to the awaiting task, as to_thread does
            error = exc
        # RuntimeError: the loop closed while the call waited, and nobody awaits it any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, error)
        # The error's traceback holds this frame: without this, the two would keep each other (and
        # what the failed call held) alive until the garbage collector came by.
        result = error = None

    threading.Thread(target=run, name="broadcast", daemon=True).start()
    return await done


def tcp_store(host: str, port: int, is_master: bool, timeout_s: float) -> TCPStore:
    """The trainer's store (`is_master`, port 0 picks a free one) or a receiver's client of it."""
    return TCPStore(
        host, port, is_master=is_master, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class BroadcastGroup:
    """One membership's process group: rank 0 (the trainer) sends, every other rank receives."""

    def __init__(self, store: Store, rendezvous: Rendezvous) -> None:
        self.name = rendezvous.group_name
        self.rank = rendezvous.rank
        self.world_size = rendezvous.world_size
        self.backend = rendezvous.backend
        timeout = timedelta(milliseconds=rendezvous.timeout_ms)
        prefixed = PrefixStore(self.name, store)
        prefixed.set(_arrival_key(self.rank), "1")  # so that a failed rendezvous can tell who never came
        if self.rank > 0 and prefixed.get(_GO_KEY) != _GO.encode():  # the trainer's word (`gather`)
            raise RendezvousAbandoned(f"group {self.name} was abandoned: a member never arrived")
        # Every rank has arrived: the constructor's own rendezvous returns at once.
        self._group: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None
        if self.backend == "gloo":
            self._group = dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timeout)
        elif self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, self.rank, self.world_size, options)
        else:
            raise ValueError(f"unknown broadcast backend {self.backend!r}; use gloo or nccl")

    def close(self) -> None:
        """Let go of the process group now. Its connections close once nothing holds it, so a peer
        still waiting on this rank (in a broadcast this rank gave up, or a group this rank left)
        fails at once instead of at its timeout: the traceback of a failed broadcast holds this
        object, and would keep the group open until the garbage collector came by, or as long as
        the exception is kept. (`abort` and `shutdown` of a gloo group leave its sockets open.)"""
        self._group = None

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send (rank 0) or receive (other ranks) `tensor` in place; raises on timeout or a lost peer."""
        if self._group is None:
            raise RuntimeError(f"group {self.name} is closed")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self._group.broadcast([tensor], options).wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's stub puts broadcast on ProcessGroup only; backends have it too
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()


class RendezvousAbandoned(RuntimeError):
    """The trainer gave up on a group before it was built: a member never arrived."""


async def gather(
    store: Store, group_name: str, members: Sequence[str], watching: Callable[[str], bool], timeout_s: float
) -> None:
    """The trainer's step of a new group's rendezvous: wait until every member (ranks 1…, in
    order) has arrived, then tell them to go on. If a member's watch stream ends first
    (`watching(member)` false), or `timeout_s` passes, tell them the group is abandoned and raise
    RendezvousAbandoned."""
    prefixed = PrefixStore(group_name, store)
    keys = [_arrival_key(rank) for rank in range(1, len(members) + 1)]
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(prefixed.check, keys):
        gone = [member for member in members if not watching(member)]
        if gone or time.monotonic() > deadline:
            prefixed.set(_GO_KEY, _ABANDONED)
            why = f"{', '.join(gone)} stopped watching" if gone else f"a member not there in {timeout_s:g}s"
            raise RendezvousAbandoned(f"group {group_name} abandoned before it was built: {why}")
        await asyncio.sleep(GATHER_POLL_S)
    prefixed.set(_GO_KEY, _GO)


def arrived(store: Store, group_name: str, rank: int) -> bool:
    """Whether `rank` reached the rendezvous of `group_name` (whatever became of it after)."""
    return PrefixStore(group_name, store).check([_arrival_key(rank)])


def _arrival_key(rank: int) -> str:
    return f"pipelinerl/arrived/{rank}"


_GO_KEY = "pipelinerl/go"
_GO, _ABANDONED = "1", "0"


def join(rendezvous: Rendezvous) -> BroadcastGroup:
    """A receiver joins the group a weight notice names."""
    timeout_s = rendezvous.timeout_ms / 1000
    return BroadcastGroup(tcp_store(rendezvous.host, rendezvous.port, False, timeout_s), rendezvous)
