"""Ctrl-C, SIGTERM and SIGHUP to `pipelinerl run` (a terminal, `kill`, a scheduler's time limit, a
container stop, a closed session) all end it the same way: the run's task is cancelled, so `launch`
stops every process it started, by its handle, and the launcher exits non-zero, unless the run had
finished by then. Nothing is restarted from then on: the supervisor is cancelled first."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """The launcher was told to stop before the run ended; every service it started is stopped."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name} before the run ended")

    @property
    def exit_code(self) -> int:
        """What a shell reports for a process ended by that signal."""
        return 128 + self.signum


async def until_signalled(main: Coroutine[Any, Any, T]) -> T:
    """`main`'s result, or Interrupted once one of SIGNALS has cancelled it (later ones are ignored:
    the processes are being stopped already)."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(main)
    received: list[int] = []

    def cancel(signum: int) -> None:
        if not received:
            received.append(signum)
            task.cancel()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, cancel, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if received and task.cancelled():
            raise Interrupted(received[0]) from None
        raise
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
