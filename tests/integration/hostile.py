"""Shared by the bad-input suites (`test_bad_input_<service>.py`): a real service as a subprocess
with a bearer token, raw calls whose status code is the result, the server's RSS, and HTTP/2
streams that end in the middle of a gRPC message (cancelled, dropped, or ended by the client).

    async with harness("pipelinerl.reward", tmp_path, memory_limit_gib=4, serves=scores_a_valid_item) as h:
        stub = reward_pb2_grpc.RewardServiceStub(h.channel)
        await h.expect(code_of(stub.Score(pb.ScoreRequest(), metadata=AUTH, timeout=10)), INVALID)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pipelinerl.common.channel import free_port
from pipelinerl.common.health import wait_until_serving
from pipelinerl.common.server import channel_options

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
NO_AUTH: tuple[tuple[str, str], ...] = ()
WRONG_AUTH = (("authorization", "Bearer wrong"),)
BASIC_AUTH = (("authorization", f"Basic {TOKEN}"),)
RAW_TOKEN_AUTH = (("authorization", TOKEN),)
AUTH_CASES = {"missing": NO_AUTH, "wrong": WRONG_AUTH, "basic": BASIC_AUTH, "no scheme": RAW_TOKEN_AUTH}
# Small enough that an oversize message is cheap to send, large enough for a 4 MiB weight chunk.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
OVERSIZE_BYTES = MAX_MESSAGE_BYTES + 1024
# Bytes that are no protobuf message: field 31, wire type 7 (there is no wire type 7).
UNDECODABLE = b"\xff\xff"
# Field 1 announces 5 bytes of length-delimited data and 2 follow.
TRUNCATED = b"\x0a\x05ab"
# Field 1 as a string of bytes that are not UTF-8.
BAD_UTF8 = b"\x0a\x02\xff\xfe"
CALL_TIMEOUT_S = 20.0
CUT_ANSWER_S = 5.0
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
NOT_FOUND = grpc.StatusCode.NOT_FOUND
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DEADLINE = grpc.StatusCode.DEADLINE_EXCEEDED
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def code_value(code: grpc.StatusCode) -> int:
    """The number of a status code, as a google.rpc.Status carries it."""
    return code.value[0]


@dataclass
class Service:
    """A service process started by this suite; stopped by its own handle."""

    module: str
    args: tuple[str, ...]
    log_path: Path
    memory_limit_gib: float
    """Address-space limit of the process: a case that makes it allocate without bound (a group of
    2**31 attempts) then fails inside the service instead of exhausting the test machine."""
    process: subprocess.Popen[bytes] | None = None
    port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rss_mb(self) -> float:
        """Resident set size of the server process, from /proc."""
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS line")

    def channel(self) -> grpc.aio.Channel:
        """A channel on a connection of its own, as another client's would be: by default gRPC
        shares one connection among channels with the same target and options, so whatever ends a
        flooded connection (a GOAWAY, streams reset in bulk) would end the harness's calls too."""
        options = [*channel_options(64 * 1024 * 1024), ("grpc.use_local_subchannel_pool", 1)]
        return grpc.aio.insecure_channel(self.address, options=options)

    async def start(self, timeout_s: float = 180) -> None:
        self.port = free_port()
        flags = ["--port", str(self.port), "--auth-token", TOKEN, "--drain-seconds", "0"]
        flags += ["--max-message-bytes", str(MAX_MESSAGE_BYTES)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module, *flags, *self.args],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                preexec_fn=self._limit_memory,
            )
        if not await wait_until_serving(self.address, timeout_s=timeout_s):
            self.stop()
            raise RuntimeError(f"{self.module} did not serve; its log ends:\n{self.tail()}")

    def _limit_memory(self) -> None:
        limit = int(self.memory_limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    async def restart(self) -> None:
        """A fresh process, for when a case left this one unable to serve."""
        self.stop()
        await self.start()

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


@contextlib.asynccontextmanager
async def service_process(
    module: str, tmp_path: Path, *args: str, memory_limit_gib: float
) -> AsyncIterator[Service]:
    """`python -m <module> --port P --auth-token TOKEN ... *args`, healthy, stopped on exit."""
    service = Service(module, args, tmp_path / f"{module}.log", memory_limit_gib)
    await service.start()
    try:
        yield service
    finally:
        service.stop()


async def code_of(call: Awaitable[Any]) -> grpc.StatusCode:
    """The status a unary call ended with."""
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return OK


async def stream_code(call: Any) -> grpc.StatusCode:
    """The status a server-streaming call ended with, after reading it to its end."""
    try:
        async with asyncio.timeout(CALL_TIMEOUT_S):
            async for _ in call:
                pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return OK


async def raw_unary(
    channel: grpc.aio.Channel, method: str, data: bytes, metadata: Any = AUTH
) -> grpc.StatusCode:
    """Send `data` as the request bytes of a unary method."""
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    return await code_of(call(data, metadata=metadata, timeout=CALL_TIMEOUT_S))


async def raw_stream(
    channel: grpc.aio.Channel, method: str, data: bytes, streaming_request: bool
) -> grpc.StatusCode:
    """Send `data` as the (first) request message of a streaming method, then read to the end. A
    request stream is left open, so only the server can end the call."""
    if streaming_request:
        call = channel.stream_stream(method, request_serializer=None, response_deserializer=None)(
            metadata=AUTH, timeout=CALL_TIMEOUT_S
        )
        await call.write(data)
    else:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)(
            data, metadata=AUTH, timeout=CALL_TIMEOUT_S
        )
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except grpc.aio.AioRpcError as err:
        return err.code()
    return call_code if (call_code := await call.code()) is not None else OK


async def code_of_cut_call(port: int, path: str) -> grpc.StatusCode:
    """The status a server answered a request cut short by the end of its stream with, within
    `CUT_ANSWER_S` (a server that never answers would hold the call until the client gives up)."""
    end = await asyncio.to_thread(message_cut_by_end_of_stream, port, path, CUT_ANSWER_S)
    assert end is not None, f"{path}: not answered in {CUT_ANSWER_S} s"
    assert end.grpc_status is not None, f"{path}: reset with HTTP/2 error {end.reset_code}"
    return STATUS_CODES[end.grpc_status]


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman coding."""
    out = b"\x00"
    for part in (name.encode(), value.encode()):
        assert len(part) < 127, "one-byte HPACK lengths only"
        out += bytes([len(part)]) + part
    return out


def _open_stream(sock: socket.socket, port: int, path: str, end_stream: bool) -> None:
    """The connection preface, then stream 1 on `path` with 10 bytes of a message whose prefix
    announces 100, ending the stream with them if `end_stream`."""
    headers = [
        (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", f"127.0.0.1:{port}"),
        ("content-type", "application/grpc"), ("te", "trailers"), ("authorization", f"Bearer {TOKEN}"),
    ]  # fmt: skip
    block = b"".join(_literal(n, v) for n, v in headers)
    data = b"\x00" + (100).to_bytes(4, "big") + b"\x0a\x08partial!"
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(0x4, 0, 0, b""))
    sock.sendall(_frame(0x1, 0x4, 1, block) + _frame(0x0, 0x1 if end_stream else 0, 1, data))


def half_sent_message(port: int, path: str, rst_stream: bool) -> None:
    """Open an HTTP/2 gRPC stream on `path`, send 10 bytes of a message whose prefix announces 100,
    then cancel the stream (RST_STREAM) or drop the connection: a client gone mid-message."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        _open_stream(sock, port, path, end_stream=False)
        if rst_stream:
            sock.sendall(_frame(0x3, 0, 1, (0x8).to_bytes(4, "big")))  # CANCEL
        sock.settimeout(0.5)
        with contextlib.suppress(OSError):
            sock.recv(65536)  # the server's SETTINGS; then hang up


@dataclass(frozen=True)
class StreamEnd:
    """How a server ended a raw HTTP/2 stream: trailers with `grpc_status`, or RST_STREAM with
    `reset_code`."""

    grpc_status: int | None
    reset_code: int | None


def message_cut_by_end_of_stream(port: int, path: str, timeout_s: float) -> StreamEnd | None:
    """Open an HTTP/2 gRPC stream on `path` and end it (END_STREAM) on 10 bytes of a message whose
    prefix announces 100: a request cut short by its own end, with the client still connected and
    waiting. How the server ended the stream, or None if it had not after `timeout_s`."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        _open_stream(sock, port, path, end_stream=True)
        started = time.monotonic()
        buffer = b""
        while (left := timeout_s - (time.monotonic() - started)) > 0:
            sock.settimeout(left)
            try:
                received = sock.recv(65536)
            except TimeoutError:
                return None
            if not received:
                return None
            buffer += received
            while len(buffer) >= 9 and len(buffer) >= 9 + (size := int.from_bytes(buffer[:3], "big")):
                kind, flags, stream = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big")
                payload, buffer = buffer[9 : 9 + size], buffer[9 + size :]
                if stream == 1 and kind == 0x3:
                    return StreamEnd(None, int.from_bytes(payload, "big"))
                if stream == 1 and kind == 0x1 and flags & 0x1:
                    return StreamEnd(_grpc_status(payload), None)
    return None


def _grpc_status(block: bytes) -> int:
    """grpc-status from a trailer block; gRPC's encoder sends it on a fresh connection as a literal
    with a plain (not Huffman-coded) value."""
    found = re.search(rb"grpc-status([\x01\x02])", block)
    assert found is not None, f"no plain grpc-status in {block.hex()}"
    return int(block[found.end() : found.end() + found[1][0]])


Check = Callable[[grpc.aio.Channel], Awaitable[None]]


@dataclass
class Harness:
    """One service of a suite and a channel to it; `recover` replaces a server a case broke."""

    service: Service
    channel: grpc.aio.Channel
    serves: Check
    """Sends a valid request and checks its answer."""
    setup: Check | None = None
    """What a fresh server needs before the cases run (the coordinator's runs)."""

    async def recover(self) -> None:
        await self.channel.close()
        await self.service.restart()
        self.channel = self.service.channel()
        if self.setup is not None:
            await self.setup(self.channel)

    async def still_serving(self) -> None:
        """Fail unless the server answers a valid request; restart it first, so that later cases
        start clean."""
        try:
            async with asyncio.timeout(30):
                await self.serves(self.channel)
        except Exception as exc:
            tail = self.service.tail()
            await self.recover()
            raise AssertionError(f"the server no longer serves a valid request: {exc!r}\n{tail}") from exc

    async def still_serving_after_a_flood(self, drain_s: float = 30.0) -> None:
        """`still_serving`, once the server has drained the calls a flood left queued.

        Thousands of calls cancelled at once stay queued in the server's gRPC core until its event
        loop has taken each and seen it cancelled, which takes seconds on a loaded machine. A call
        made meanwhile is sometimes answered CANCELLED by gRPC core (grpcio 1.85) before any of the
        server's code sees it: measured under three busy loops on two cores, 7 of 60 valid calls
        made right after 2,000 abandoned ones, none of which reached the first interceptor. Such a
        call is retried here for up to `drain_s`; any other answer, or CANCELLED for the whole
        while, fails as `still_serving` does."""
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            try:
                async with asyncio.timeout(CALL_TIMEOUT_S):
                    await self.serves(self.channel)
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.CANCELLED:
                    break
            await asyncio.sleep(0.5)
        await self.still_serving()

    async def expect(self, call: Awaitable[grpc.StatusCode], *codes: grpc.StatusCode) -> None:
        """`call` ends with one of `codes`, and the server still serves a valid request after it."""
        try:
            code = await call
        finally:
            await self.still_serving()
        assert code in codes, f"{code} is not {codes}"


@contextlib.asynccontextmanager
async def harness(
    module: str,
    tmp_path: Path,
    *args: str,
    memory_limit_gib: float,
    serves: Check,
    setup: Check | None = None,
) -> AsyncIterator[Harness]:
    async with service_process(module, tmp_path, *args, memory_limit_gib=memory_limit_gib) as service:
        h = Harness(service, service.channel(), serves, setup)
        try:
            if setup is not None:
                await setup(h.channel)
            yield h
        finally:
            await h.channel.close()


async def abandon_calls(
    service: Service,
    open_call: Callable[[grpc.aio.Channel], Any],
    count: int,
    batch: int = 250,
    first_response: bool = True,
) -> None:
    """Open `count` calls, `batch` at a time on a channel of their own, wait for each call's first
    response (or its end) if the server sends one unasked, then cancel every other call and abandon
    the rest by closing the channel."""
    for start in range(0, count, batch):
        async with service.channel() as channel:
            calls = [open_call(channel) for _ in range(min(batch, count - start))]
            if first_response:
                await asyncio.gather(*(_first(call) for call in calls))
            else:
                await asyncio.sleep(0.1)  # let the calls reach the server
            for call in calls[::2]:
                call.cancel()


async def _first(call: Any) -> None:
    with contextlib.suppress(grpc.aio.AioRpcError):
        await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
