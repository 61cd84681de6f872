"""The four services for the TypeScript client's tests, as `pipelinerl run` starts them.

    python harness.py TOKEN RUN_DIR

Starts reward, trainer, an inference server and the coordinator on 127.0.0.1 (free ports, tiny
model on CPU, every service behind the bearer token TOKEN, logs in RUN_DIR), prints one JSON line
`{"reward": "127.0.0.1:…", "trainer": …, "inference-0": …, "coordinator": …}` once all are
serving, and stops them (each by its own handle) when stdin closes or on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from pipelinerl.common.log import configure_logging
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess, stop_all
from pipelinerl.launcher.run import start_services


async def main(token: str, run_dir: Path) -> None:
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, done.set)
    await loop.connect_read_pipe(lambda: _SetOnEof(done), sys.stdin)
    processes: list[ServiceProcess] = []
    try:
        # Two optimizer steps in a run of 128 samples, so weight versions reach the inference server.
        await start_services(RunSettings(run_dir=run_dir, auth_token=token, samples_per_step=64), processes)
        sys.stdout.write(json.dumps({p.name: p.address for p in processes}) + "\n")
        sys.stdout.flush()
        await done.wait()
    finally:
        await stop_all(processes)


class _SetOnEof(asyncio.Protocol):
    def __init__(self, done: asyncio.Event) -> None:
        self._done = done

    def connection_lost(self, exc: Exception | None) -> None:
        self._done.set()


if __name__ == "__main__":
    configure_logging("harness")
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
