"""How the environment service runs an environment's code: a coroutine function in the event loop,
a plain function on a worker thread.

    await run_code(env.step, action)    # async def step: awaited here; def step: on a worker

Plain functions run on daemon threads that are kept between calls: a call takes an idle worker or
starts a new one, never waits for a busy one. So a call that never returns holds only its own
thread, which cannot be stopped (it is abandoned when its time limit passes, and the process exits
without it), as with a thread started per call; but a steady stream of calls reuses a few threads
instead of starting one per call (`benchmarks/environment_table.py`: with plain methods the episode
table spends a third of the CPU per episode it spent with a thread per call). A worker idle for
`IDLE_EXIT_S` exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import queue
import threading
from collections.abc import Callable
from typing import Any

IDLE_EXIT_S = 30.0


async def run_code(fn: Callable[..., Any], *args: Any) -> Any:
    """Run an environment method: a coroutine function in this loop, a plain one on a worker
    thread; an awaitable that a plain one returns is awaited here."""
    result = await fn(*args) if inspect.iscoroutinefunction(fn) else await _in_thread(fn, *args)
    if inspect.isawaitable(result):
        result = await result
    return result


class Workers:
    """Daemon threads that run calls, each on a worker that is idle at the time or a new one."""

    def __init__(self, idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._idle_exit_s = idle_exit_s
        self._lock = threading.Lock()
        self._idle = 0
        """Workers waiting for a call and not yet claimed by one."""
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.started = 0
        """Threads started so far."""

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            claimed = self._idle > 0
            self._idle -= claimed
            self.started += not claimed
        self._calls.put(call)
        if not claimed:
            threading.Thread(target=self._work, name="env worker", daemon=True).start()

    @property
    def idle(self) -> int:
        return self._idle

    def _work(self) -> None:
        while True:
            try:
                call = self._calls.get(timeout=self._idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if self._idle > 0:  # no call claimed this worker meanwhile: it exits
                        self._idle -= 1
                        return
                continue  # a call claimed it as it timed out: the call is queued, take it
            call()
            with self._lock:
                self._idle += 1


_workers = Workers()


def _in_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
    """`fn(*args)` on a worker thread, in a copy of the caller's context."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()
    context = contextvars.copy_context()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # the caller's time limit passed
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def run() -> None:
        try:
            outcome: tuple[Any, BaseException | None] = (context.run(fn, *args), None)
        except BaseException as exc:
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    _workers.submit(run)
    return future
