"""Broadcast groups of their own, one per membership, outside torch.distributed's global world.

Inference servers come and go while the trainer runs, so the trainer cannot hold one fixed
`init_process_group` world. Like vLLM's stateless process group, each membership (the set of
receivers present when a version is published) gets a process group object built directly on a
`PrefixStore(group_name, TCPStore)`; the trainer hosts the TCPStore and is rank 0. A new membership
means a new group name and a new rendezvous; the old group is dropped.

Blocking calls (rendezvous, broadcast) run in threads of their own (`in_own_thread`); gloo and NCCL
release the GIL.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]  # public, re-exported without `as`
from torch.distributed.distributed_c10d import PrefixStore, Store

from pipelinerl.weights.types import Rendezvous

T = TypeVar("T")


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
        # The constructor is itself the rendezvous: it returns once every rank has joined.
        if self.backend == "gloo":
            self._group = dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, timeout)
        elif self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self._group = dist.ProcessGroupNCCL(prefixed, self.rank, self.world_size, options)
        else:
            raise ValueError(f"unknown broadcast backend {self.backend!r}; use gloo or nccl")

    @property
    def device(self) -> torch.device:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Send (rank 0) or receive (other ranks) `tensor` in place; raises on timeout or a lost peer."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        self._group.broadcast([tensor], options).wait()  # pyright: ignore[reportAttributeAccessIssue]  # torch's stub puts broadcast on ProcessGroup only; backends have it too
        if self.backend == "nccl":
            torch.cuda.current_stream().synchronize()


def arrived(store: Store, group_name: str, rank: int) -> bool:
    """Whether `rank` reached the rendezvous of `group_name` (whatever became of it after)."""
    return PrefixStore(group_name, store).check([_arrival_key(rank)])


def _arrival_key(rank: int) -> str:
    return f"pipelinerl/arrived/{rank}"


def join(rendezvous: Rendezvous) -> BroadcastGroup:
    """A receiver joins the group a weight notice names."""
    timeout_s = rendezvous.timeout_ms / 1000
    return BroadcastGroup(tcp_store(rendezvous.host, rendezvous.port, False, timeout_s), rendezvous)
