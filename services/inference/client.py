"""Typed asyncio client of the inference server.

`GenerateSession` holds one Generate stream and honours the server's flow-control window: a call
to `generate()` waits for a free slot before it submits, so the client never overfills the server.
However the stream ends (the server drains or crashes, the call is cancelled, a write finds it
finished), every request on it fails with Unavailable: the server went away, not the request.

When the server accepts batches (`Capacity.accepts_batches`), submissions go out through one writer
task: whatever was submitted while the previous message was being written leaves as one
`SubmissionBatch`, and the server answers with `CompletionBatch`es. Callers see no difference; a
group of concurrent `generate()` calls costs one message each way instead of one per request.

    async with InferenceClient("127.0.0.1:50051") as client, client.session() as session:
        completion = await session.generate(GenerationRequest("r1", [1, 2, 3], SamplingParams()))

A request pinned to a weight version the server does not hold raises `VersionNotHeld`, whose
`held_version` is the version to ask for instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import grpc

from pipelinerl.common import convert, trace
from pipelinerl.common.channel import ChannelConfig, ServiceClient
from pipelinerl.common.errors import InvalidArgument, PipelineError, Unavailable
from pipelinerl.common.status import domain_errors
from pipelinerl.common.types import TokenSequence
from pipelinerl.inference.convert import (
    completion_from_proto,
    model_info_from_proto,
    request_error_from_status,
    status_from_proto,
    submission_to_proto,
)
from pipelinerl.inference.types import Completion, GenerationRequest, InferenceStatus, ModelInfo
from pipelinerl.inference.v1 import inference_pb2 as pb
from pipelinerl.inference.v1 import inference_pb2_grpc

DeltaCallback = Callable[[TokenSequence], None]


class GenerateSession:
    """One Generate stream carrying many concurrent requests."""

    def __init__(self, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
        self._stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, tuple[asyncio.Future[Completion], DeltaCallback | None]] = {}
        self._slots = asyncio.Condition()
        self._write_lock = asyncio.Lock()  # a gRPC call takes one write at a time
        self._outbox: list[tuple[pb.Submission, asyncio.Future[None]]] = []
        """Submissions waiting for the writer, each with a future set once it is written."""
        self._outbox_ready = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._accepts_batches = False
        self._window = 0
        self._capacity = asyncio.Event()
        self._ended: str | None = None
        """Why the stream ended, once it has."""
        self._closing = False
        self.max_new_tokens = 0
        self.max_context = 0
        self.model_info: ModelInfo | None = None
        """The served model, from the first Capacity message."""

    @property
    def window(self) -> int:
        """Requests the server accepts in flight on this stream now; 0 once it is ending."""
        return 0 if self._ended is not None or self._closing else self._window

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    async def __aenter__(self) -> GenerateSession:
        self._call = self._stub.Generate()
        self._reader = asyncio.create_task(self._read())
        self._writer = asyncio.create_task(self._write_batches())
        await self._capacity.wait()
        if self._ended is not None:
            await self.__aexit__()  # `async with` does not call it when entering fails
            raise self._gone()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._writer is not None:
            self._writer.cancel()
        tasks = [task for task in (self._reader, self._writer) if task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._fail_outbox()

    async def wait_closed(self) -> str:
        """Until the stream has ended; why it ended."""
        assert self._reader is not None, "use `async with session`"
        await asyncio.wait([self._reader])  # never raises: a cancelled call ends the reader cancelled
        return self._ended or ""

    async def close_when_idle(self) -> None:
        """Half-close: no new request; the server finishes those in flight, then ends the stream."""
        async with self._slots:
            self._closing = True
            self._slots.notify_all()
        assert self._call is not None
        async with self._write_lock:
            with contextlib.suppress(PipelineError):
                await self._flush_locked()  # what was submitted before goes out first
            with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                await self._call.done_writing()

    async def generate(self, request: GenerationRequest, on_delta: DeltaCallback | None = None) -> Completion:
        """Submit once a slot is free and wait for the completion. Cancelling this coroutine cancels
        the request on the server. Raises the request's domain error (InvalidArgument,
        VersionNotHeld, ...)."""
        assert self._call is not None, "use `async with session`"
        async with self._slots:
            # A window of 0 means the server drains: it takes nothing new on this stream.
            await self._slots.wait_for(lambda: len(self._pending) < self.window or self.window == 0)
            if self.window == 0:
                raise self._gone()
            if request.request_id in self._pending:  # its answers could not be told apart: refused
                why = f"{request.request_id!r} is in flight on this stream"
                raise InvalidArgument.field("request_id", why)
            future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
            self._pending[request.request_id] = (future, on_delta)
        # The trace: the attempt's ids, for the server's log lines about it.
        submission = submission_to_proto(request, stream_tokens=on_delta is not None, trace=trace.bound())
        queued: tuple[pb.Submission, asyncio.Future[None]] | None = None
        try:
            if self._accepts_batches:
                queued = (submission, asyncio.get_running_loop().create_future())
                self._outbox.append(queued)
                self._outbox_ready.set()
                await queued[1]
            else:
                await self._write(pb.GenerateRequest(submit=submission))
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if queued is not None:
                queued[1].cancel()  # nobody reads how its write went now
            if queued in self._outbox:  # never sent: nothing to cancel on the server
                self._outbox.remove(queued)
            else:
                cancel = pb.GenerateRequest(cancel=pb.Cancellation(request_id=request.request_id))
                with contextlib.suppress(PipelineError):  # a stream that has ended has no request to cancel
                    await self._write(cancel)
            raise
        finally:
            async with self._slots:
                self._pending.pop(request.request_id, None)
                self._slots.notify_all()
            if not future.cancel():  # done already: mark an error it holds seen (this call has ended)
                future.exception()

    async def _write(self, message: pb.GenerateRequest) -> None:
        """Unavailable if the stream has ended, also while this write waited for its turn."""
        async with self._write_lock:
            await self._write_locked(message)

    async def _write_locked(self, message: pb.GenerateRequest) -> None:
        assert self._call is not None
        if self._ended is not None:
            raise self._gone()
        try:
            await self._call.write(message)
        except (asyncio.InvalidStateError, grpc.aio.AioRpcError) as exc:  # finished, or failed under us
            raise Unavailable(f"the Generate stream ended: {exc}") from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise Unavailable("the Generate stream was cancelled") from None  # the call, not this task

    async def _write_batches(self) -> None:
        """The writer: sends the outbox as one `SubmissionBatch` whenever it holds something."""
        while True:
            await self._outbox_ready.wait()
            async with self._write_lock:
                self._outbox_ready.clear()
                with contextlib.suppress(PipelineError):  # the batch's callers have it
                    await self._flush_locked()

    async def _flush_locked(self) -> None:
        """Write the whole outbox in one message and tell its callers how it went."""
        batch, self._outbox = self._outbox, []
        if not batch:
            return
        try:
            await self._write_locked(
                pb.GenerateRequest(submit_batch=pb.SubmissionBatch(submissions=[s for s, _ in batch]))
            )
        except BaseException as exc:
            for _, written in batch:
                if not written.done():  # a new error for each caller, as `_gone` does
                    error = Unavailable(exc.message) if isinstance(exc, PipelineError) else self._gone()
                    written.set_exception(error)
            raise
        for _, written in batch:
            if not written.done():
                written.set_result(None)

    def _fail_outbox(self) -> None:
        batch, self._outbox = self._outbox, []
        for _, written in batch:
            if not written.done():
                written.set_exception(self._gone())

    async def _read(self) -> None:
        assert self._call is not None
        why = "the Generate stream was cancelled"
        try:
            # read() rather than `async for`: gRPC forbids mixing iteration with write().
            # read() returns grpc.aio.EOF once the server ends the stream.
            while isinstance(response := await self._call.read(), pb.GenerateResponse):
                await self._dispatch(response)
            why = "the inference server ended the stream"
        except grpc.aio.AioRpcError as err:  # any status: the server went away, not the requests
            why = f"the Generate stream failed: {err.code().name}: {err.details()}"
        finally:
            self._ended = why
            self._capacity.set()
            for future, _ in self._pending.values():
                if not future.done():
                    future.set_exception(self._gone())
            async with self._slots:
                self._slots.notify_all()

    def _gone(self) -> Unavailable:
        """A new error for each caller: one instance raised in many tasks would pile up tracebacks."""
        return Unavailable(self._ended or "the inference server takes no new request on this stream")

    async def _dispatch(self, response: pb.GenerateResponse) -> None:
        event = response.WhichOneof("event")
        if event == "capacity":
            self.max_new_tokens = response.capacity.max_new_tokens
            self.max_context = response.capacity.max_context
            self.model_info = model_info_from_proto(response.capacity.model_info)
            self._accepts_batches = response.capacity.accepts_batches
            async with self._slots:
                self._window = response.capacity.max_in_flight
                self._slots.notify_all()
            self._capacity.set()
            return
        if event == "completions":
            for completion in response.completions.completions:
                self._complete(completion)
            return
        if event == "completion":
            self._complete(response.completion)
            return
        request_id = getattr(response, event).request_id
        future, on_delta = self._pending.get(request_id, (None, None))
        if future is None or future.done():
            return
        if event == "delta" and on_delta is not None:
            on_delta(convert.tokens_from_proto(response.delta.tokens))
        elif event == "error":
            future.set_exception(request_error_from_status(response.error.status))

    def _complete(self, message: pb.Completion) -> None:
        future, _ = self._pending.get(message.request_id, (None, None))
        if future is not None and not future.done():
            future.set_result(completion_from_proto(message))


class InferenceClient(ServiceClient):
    def __init__(self, config: ChannelConfig | str) -> None:
        super().__init__(config)
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)

    def session(self) -> GenerateSession:
        """A new Generate stream (use with `async with`)."""
        return GenerateSession(self._stub)

    async def status(self, timeout_s: float | None = None) -> InferenceStatus:
        with domain_errors():
            return status_from_proto(await self._stub.GetStatus(pb.GetStatusRequest(), timeout=timeout_s))
