"""A TCP proxy in front of one service, with faults switched on for a while: what a flaky network
does to the gRPC connections between services.

    client ──► 127.0.0.1:<proxy port> ──► upstream (the service's own address)
    latency  every chunk leaves `delay_s` after it came, either way (a delay line: throughput holds)
    stall    nothing is forwarded either way, every socket stays open (a hung peer or a full queue)
    reset    every connection, open or new, is closed with RST on both sides (SO_LINGER 0)
    drop     every connection, open or new, is closed with FIN on both sides

With no fault on, the bytes pass unchanged, so gRPC over HTTP/2 works through it as without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable
from enum import StrEnum

CHUNK = 65536
LINE_CHUNKS = 64
"""Chunks a direction holds in its delay line before it stops reading (TCP then pushes back)."""
UPSTREAM_WAIT_S = 60.0
"""How long a connection waits for the upstream's address to be known (a service still starting)."""
UPSTREAM_POLL_S = 0.05


class Fault(StrEnum):
    LATENCY = "latency"
    STALL = "stall"
    RESET = "reset"
    DROP = "drop"


class FaultProxy:
    """Listens on a port of 127.0.0.1 of its own from construction on (connections wait in the
    backlog until `start`). `upstream()` is the service's address, None until it is known; once
    known it is kept, since a restarted service binds the same port."""

    def __init__(self, upstream: Callable[[], str | None]) -> None:
        self._upstream = upstream
        self._known: tuple[str, int] | None = None
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # As servers do: its closed connections' TIME_WAIT then keeps no one from binding the port.
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self._socket.listen(128)
        self.port: int = self._socket.getsockname()[1]
        self.fault: Fault | None = None
        self.delay_s = 0.0
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._connections: set[_Connection] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accepted, sock=self._socket)

    async def close(self) -> None:
        """Stop listening and close every connection (FIN)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        else:
            self._socket.close()
        self.set_fault(None)
        for connection in list(self._connections):
            connection.close(Fault.DROP)
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    def set_fault(self, fault: Fault | None, delay_s: float = 0.0) -> None:
        """Switch `fault` on (`delay_s` for latency) until the next call; None: no fault."""
        self.fault = fault
        self.delay_s = delay_s if fault is Fault.LATENCY else 0.0
        if fault is Fault.STALL:
            self._flowing.clear()
        else:
            self._flowing.set()
        if fault in (Fault.RESET, Fault.DROP):
            for connection in list(self._connections):
                connection.close(fault)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            await self._serve(reader, writer)
        finally:
            self._handlers.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        self._connections.add(connection)
        try:
            if self.fault not in (Fault.RESET, Fault.DROP):
                await self._relay(reader, connection)
        finally:
            self._connections.discard(connection)
            connection.close(self.fault if self.fault in (Fault.RESET, Fault.DROP) else None)

    async def _relay(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        """Forward both ways until either end closes. An upstream that refuses (the service is
        down) is, to the client, a connection that ends at once."""
        upstream = await self._upstream_address()
        if upstream is None:
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError:
            return
        connection.writers.append(up_writer)
        if self.fault in (Fault.RESET, Fault.DROP):  # switched on while it connected
            return
        client = connection.writers[0]
        ways = [
            asyncio.ensure_future(self._forward(reader, up_writer)),
            asyncio.ensure_future(self._forward(up_reader, client)),
        ]
        try:
            await asyncio.wait(ways, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for way in ways:
                way.cancel()
            await asyncio.gather(*ways, return_exceptions=True)

    async def _upstream_address(self) -> tuple[str, int] | None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + UPSTREAM_WAIT_S
        while self._known is None and loop.time() < deadline:
            address = self._upstream()
            if address is not None:
                host, port = address.rsplit(":", 1)
                self._known = (host, int(port))
            else:
                await asyncio.sleep(UPSTREAM_POLL_S)
        return self._known

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction, through a delay line, until either end closes: each chunk is sent at the
        time it came plus the delay then on, so a delay adds latency without capping throughput."""
        loop = asyncio.get_running_loop()
        line: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(LINE_CHUNKS)

        async def take() -> None:
            data = b"-"
            try:
                while data:
                    await self._flowing.wait()
                    data = await reader.read(CHUNK)
                    await line.put((loop.time() + self.delay_s, data))
            except OSError:
                await line.put((0.0, b""))

        taking = asyncio.ensure_future(take())
        try:
            while True:
                due, data = await line.get()
                await asyncio.sleep(max(due - loop.time(), 0.0))
                await self._flowing.wait()
                if not data:
                    return
                writer.write(data)
                await writer.drain()
        finally:
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)


class _Connection:
    """The proxy's sockets of one client connection (the client's, and the upstream's once open)."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.writers = [client]

    def close(self, fault: Fault | None) -> None:
        """RST for `Fault.RESET`, FIN otherwise."""
        for writer in self.writers:
            if fault is Fault.RESET:
                sock = writer.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                writer.transport.abort()
            else:
                writer.close()
