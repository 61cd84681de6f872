"""How an environment's plain methods run: on worker threads kept between calls, never behind a
busy one, with the caller's context and exceptions."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time

import pytest

from pipelinerl.environment import calls
from pipelinerl.environment.calls import Workers, run_code

LABEL = contextvars.ContextVar("label", default="none")


async def test_calls_in_turn_start_no_thread() -> None:
    await run_code(threading.current_thread)
    started = calls._workers.started
    threads = [await run_code(threading.current_thread) for _ in range(50)]
    assert calls._workers.started == started  # no call started a thread: each took an idle worker
    assert all(thread is not threading.main_thread() for thread in threads)


async def test_a_hung_call_holds_only_its_own_thread() -> None:
    release = threading.Event()
    hung = asyncio.ensure_future(run_code(release.wait, 10))
    await asyncio.sleep(0.05)
    try:
        began = time.monotonic()
        assert await asyncio.wait_for(run_code(lambda: "answered"), 2) == "answered"
        assert time.monotonic() - began < 1
        assert not hung.done()
    finally:
        release.set()
    assert await hung is True


async def test_calls_at_once_each_get_a_thread() -> None:
    # Eight calls that can only finish together: a pool of fewer threads would time out.
    barrier = threading.Barrier(8, timeout=5)
    threads = await asyncio.gather(
        *(run_code(lambda: (barrier.wait(), threading.get_ident())[1]) for _ in range(8))
    )
    assert len(set(threads)) == 8


async def test_the_callers_context_and_exceptions_cross_the_thread() -> None:
    LABEL.set("episode 7")
    assert await run_code(LABEL.get) == "episode 7"

    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        await run_code(fail)


async def test_coroutine_functions_and_returned_awaitables_run_in_the_loop() -> None:
    loop = asyncio.get_running_loop()

    async def in_loop() -> bool:
        return asyncio.get_running_loop() is loop

    assert await run_code(in_loop) is True
    assert await run_code(lambda: in_loop()) is True  # a plain function returning a coroutine
    assert calls._workers.idle >= 1


def test_an_idle_worker_exits_and_a_later_call_starts_another() -> None:
    workers = Workers(idle_exit_s=0.05)
    done = threading.Event()
    workers.submit(done.set)
    assert done.wait(2)
    deadline = time.monotonic() + 2
    while workers.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert workers.idle == 0
    again = threading.Event()
    workers.submit(again.set)
    assert again.wait(2)
    assert workers.started == 2


def test_a_worker_claimed_as_it_times_out_takes_the_call() -> None:
    # Claims racing the idle timeout: every call still runs, none waits for a worker that exited.
    workers = Workers(idle_exit_s=0.001)
    ran = threading.Semaphore(0)
    for _ in range(200):
        workers.submit(ran.release)
        time.sleep(0.001)
    assert all(ran.acquire(timeout=2) for _ in range(200))
