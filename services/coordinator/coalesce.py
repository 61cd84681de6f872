"""Calls made in one turn of the event loop, sent as one: the coordinator's Score calls.

A group's attempts often finish in the same decode step, and one `CompletionBatch` brings them to
the coordinator together, so several groups ask for their scores in the same turn of the event
loop. A Score call costs the reward service about a millisecond whatever it holds (0.11 ms of its
CPU per item in calls of 8 items, 0.035 ms in calls of 64), so those requests leave as one call:

    call(items) ─► pending ─(next turn of the loop)─► the pending requests, spread over as many calls
                                                       as there are callees up (`parallel()`), at
                                                       most `max_items` items per call
                ◄── its own results, in its order ◄── each reply, split by caller

So with one reward replica the requests of a turn go as one call, and with several each replica
still gets a share. Nothing waits for company: a request made alone leaves on the next turn, as it
would have. A merged call that fails as a whole (the callee refused the batch itself) is sent again
caller by caller, so that one caller's bad items fail that caller only. A caller cancelled before
its call leaves is dropped from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Request(Generic[Item, Result]):
    items: list[Item]
    timeout_s: float
    reply: asyncio.Future[list[Result]]


class Coalescer(Generic[Item, Result]):
    """`await coalescer(items, timeout_s)` answers as `call(items, timeout_s)` would, one result per
    item in order; requests made in the same turn of the event loop share one `call`."""

    def __init__(
        self,
        call: Callable[[list[Item], float], Awaitable[list[Result]]],
        *,
        max_items: int,
        parallel: Callable[[], int] = lambda: 1,
    ) -> None:
        """`parallel()` is how many calls the requests of one turn may spread over."""
        self._call = call
        self._max_items = max_items
        self._parallel = parallel
        self._pending: list[_Request[Item, Result]] = []
        self._calls: set[asyncio.Task[None]] = set()
        self.calls = 0
        """Calls made, each caller's resend after a refused merged call included."""

    async def __call__(self, items: list[Item], timeout_s: float) -> list[Result]:
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._send)
        request = _Request(items, timeout_s, loop.create_future())
        self._pending.append(request)
        return await request.reply

    def close(self) -> None:
        """Cancel the calls in flight (their callers get CancelledError)."""
        for task in self._calls:
            task.cancel()

    def _send(self) -> None:
        pending = [request for request in self._pending if not request.reply.done()]
        self._pending = []
        calls: list[list[_Request[Item, Result]]] = [[] for _ in range(max(1, self._parallel()))]
        sizes = [0] * len(calls)
        for request in pending:
            # The emptiest call takes it, or a call of its own once that one would be too big.
            index = min(range(len(calls)), key=sizes.__getitem__)
            if calls[index] and sizes[index] + len(request.items) > self._max_items:
                calls.append([])
                sizes.append(0)
                index = len(calls) - 1
            calls[index].append(request)
            sizes[index] += len(request.items)
        for requests in calls:
            if requests:
                self._start(requests)

    def _start(self, requests: list[_Request[Item, Result]]) -> None:
        task = asyncio.create_task(self._merged(requests))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _merged(self, requests: list[_Request[Item, Result]]) -> None:
        if len(requests) == 1:
            await self._alone(requests[0])
            return
        items = [item for request in requests for item in request.items]
        try:
            results = await self._counted(items, max(request.timeout_s for request in requests))
        except asyncio.CancelledError:
            _fail(requests, asyncio.CancelledError())
            raise
        except Exception:  # the batch was refused: each caller's own call says whose items
            await asyncio.gather(*(self._alone(request) for request in requests))
            return
        start = 0
        for request in requests:
            end = start + len(request.items)
            if not request.reply.done():
                request.reply.set_result(results[start:end])
            start = end

    async def _alone(self, request: _Request[Item, Result]) -> None:
        try:
            results = await self._counted(request.items, request.timeout_s)
        except asyncio.CancelledError:
            _fail([request], asyncio.CancelledError())
            raise
        except Exception as exc:
            _fail([request], exc)
            return
        if not request.reply.done():
            request.reply.set_result(results)

    async def _counted(self, items: list[Item], timeout_s: float) -> list[Result]:
        self.calls += 1
        return await self._call(items, timeout_s)


def _fail(requests: list[_Request[Item, Result]], exc: BaseException) -> None:
    for request in requests:
        if request.reply.done():
            continue
        if isinstance(exc, asyncio.CancelledError):
            request.reply.cancel()
        else:
            request.reply.set_exception(exc)
