"""What a run leaves behind: every process it started (each handle the launcher held, its restarts'
too, and their descendants, such as a reward replica's scoring workers) still alive after it, and
the ports its services and proxies listened on still taken. Linux /proc only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from pathlib import Path

from pipelinerl.launcher.processes import ServiceProcess

LOOK_EVERY_S = 0.2
"""Often enough to see each handle: a restart waits its backoff and the service's start after it."""
GONE_WITHIN_S = 15.0
"""After the run: a reward replica's forkserver sees its parent gone on a pipe's EOF, a moment later."""


class Tracker:
    """Every process seen among `processes` (the launcher's handles, replaced in place on a
    restart) and below them, as pid → (start time, command line), so that a reused pid is not
    taken for one of the run's."""

    def __init__(self, processes: list[ServiceProcess]) -> None:
        self._processes = processes
        self._handles: dict[int, ServiceProcess] = {}
        self.seen: dict[int, tuple[str, str]] = {}

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            self.look()
            await asyncio.sleep(LOOK_EVERY_S)

    def look(self) -> None:
        for service in list(self._processes):
            self._handles[id(service)] = service
            for pid in _tree(service.process.pid):
                if pid not in self.seen and (identity := _identity(pid)) is not None:
                    self.seen[pid] = identity

    async def leaks(self, proxy_ports: list[int]) -> dict[str, list]:
        """`leaked_processes` (command lines, each process then SIGKILLed by its pid) and
        `leaked_ports`, once the run is over."""
        self.look()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + GONE_WITHIN_S
        while (alive := self._alive()) and loop.time() < deadline:
            await asyncio.sleep(0.2)
        for pid in alive:  # ours, by its start time: stop it so that the next run has the cores
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ports = {p for s in self._handles.values() for p in (s.port, s.metrics_port) if p} | set(proxy_ports)
        taken = sorted(p for p in ports if not _free(p))
        return {"leaked_processes": [self.seen[pid][1] for pid in alive], "leaked_ports": taken}

    def _alive(self) -> list[int]:
        return [pid for pid, (started, _) in self.seen.items() if (_identity(pid) or ("", ""))[0] == started]


def _tree(pid: int) -> list[int]:
    """`pid` and every live descendant of it."""
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(child) for child in (task / "children").read_text().split()]
    return found


def _identity(pid: int) -> tuple[str, str] | None:
    """(start time, command line) of a live process (running or stopped; not a zombie), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return None
    return None if fields[0] == "Z" else (fields[19], command)


def _free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:`port` (SO_REUSEADDR: connections in TIME_WAIT do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
    return True
