"""gRPC servicer of the inference server: the Generate stream's flow control and proto <-> domain
conversion around an `InferenceBackend`.

    client ──submit/cancel──► _GenerateStream ──► one task per request: backend.generate(...)
           ◄── capacity, deltas, completions, errors ── outbound queue ◄──┘
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from prometheus_client import CollectorRegistry

from pipelinerl.common import convert, trace
from pipelinerl.common.errors import InvalidArgument, PipelineError, ResourceExhausted, Unavailable
from pipelinerl.common.log import bind_context, get_logger
from pipelinerl.common.server import Registration
from pipelinerl.common.status import item_status
from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.inference.convert import capacity_to_proto, completion_to_proto, status_to_proto
from pipelinerl.inference.metrics import InferenceMetrics
from pipelinerl.inference.types import Completion, GenerationRequest, InferenceBackend
from pipelinerl.inference.v1 import inference_pb2 as pb
from pipelinerl.inference.v1 import inference_pb2_grpc

log = get_logger(__name__)

MAX_REQUEST_ID_BYTES = 128


class _GenerateStream:
    """State of one Generate call: requests in flight on it and the responses to send."""

    def __init__(self, backend: InferenceBackend, draining: asyncio.Event, metrics: InferenceMetrics) -> None:
        self._backend = backend
        self._draining = draining
        self._metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._out: asyncio.Queue[pb.GenerateResponse | Exception | None] = asyncio.Queue()
        """Responses to send; None ends the stream, an exception ends it with that error."""

    async def run(
        self, requests: AsyncIterator[pb.GenerateRequest]
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        yield capacity_to_proto(self._backend.limits, self._backend.model_info, self._window())
        reader = asyncio.create_task(self._read(requests))
        drain_watch = asyncio.create_task(self._on_drain())
        try:
            while (response := await self._out.get()) is not None:
                if isinstance(response, Exception):
                    raise response
                yield response
        finally:
            for task in (reader, drain_watch, *self._tasks.values()):
                task.cancel()

    def _window(self) -> int:
        return 0 if self._draining.is_set() else self._backend.limits.max_running

    async def _read(self, requests: AsyncIterator[pb.GenerateRequest]) -> None:
        try:
            async for request in requests:
                action = request.WhichOneof("action")
                if action == "submit":
                    self._submit(request.submit)
                elif action == "cancel" and (task := self._tasks.get(request.cancel.request_id)):
                    task.cancel()
        except Exception as exc:  # e.g. a malformed message: end the stream with it, never hang
            self._out.put_nowait(exc)
            return
        # The client half-closed: finish what is running, then end the stream.
        await self._wait_idle()
        self._out.put_nowait(None)

    async def _on_drain(self) -> None:
        await self._draining.wait()
        self._out.put_nowait(capacity_to_proto(self._backend.limits, self._backend.model_info, 0))
        await self._wait_idle()
        self._out.put_nowait(None)

    async def _wait_idle(self) -> None:
        while self._tasks:
            await asyncio.wait(list(self._tasks.values()))

    def _submit(self, msg: pb.Submission) -> None:
        request_id = msg.request_id
        try:
            request, ids = self._validate(msg), self._trace_ids(msg)
        except PipelineError as exc:
            self._out.put_nowait(
                pb.GenerateResponse(error=pb.RequestError(request_id=request_id, status=item_status(exc)))
            )
            return
        task = asyncio.create_task(self._generate(request, ids))
        self._tasks[request_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(request_id, None))

    def _validate(self, msg: pb.Submission) -> GenerationRequest:
        if not msg.request_id or len(msg.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise InvalidArgument.field("submit.request_id", f"must be 1 to {MAX_REQUEST_ID_BYTES} bytes")
        if msg.request_id in self._tasks:
            raise InvalidArgument.field("submit.request_id", "already in flight on this stream")
        if self._draining.is_set():
            raise Unavailable("server is shutting down")
        if len(self._tasks) >= self._backend.limits.max_running:
            raise ResourceExhausted(f"more than {self._backend.limits.max_running} requests in flight")
        if bool(msg.prompt_token_ids) == bool(msg.prompt_text):
            raise InvalidArgument.field(
                "submit.prompt_token_ids", "set exactly one of prompt_token_ids and prompt_text"
            )
        prompt = list(msg.prompt_token_ids) or self._backend.tokenize(msg.prompt_text)
        sampling = convert.sampling_from_proto(msg.sampling, "submit.sampling")
        return GenerationRequest(msg.request_id, prompt, sampling, msg.stream_tokens)

    @staticmethod
    def _trace_ids(msg: pb.Submission) -> dict[str, str]:
        """The ids the request's log lines carry: its `trace` map, its id as `sample_id` by default."""
        for key, value in msg.trace.items():
            if key not in trace.FIELDS:
                known = ", ".join(trace.FIELDS)
                raise InvalidArgument.field("submit.trace", f"unknown key {key[:32]!r}: keys are {known}")
            if len(value.encode()) > MAX_REQUEST_ID_BYTES:
                raise InvalidArgument.field(f"submit.trace[{key}]", f"at most {MAX_REQUEST_ID_BYTES} bytes")
        return {"sample_id": msg.request_id, **msg.trace}

    async def _generate(self, request: GenerationRequest, ids: dict[str, str]) -> None:
        tokens = TokenSequence()
        rid = request.request_id
        bind_context(**ids)
        try:
            async for update in self._backend.generate(request):
                tokens.extend(update.tokens)
                if request.stream_tokens and update.tokens:  # the final step's tokens too
                    delta = pb.TokenDelta(request_id=rid, tokens=convert.tokens_to_proto(update.tokens))
                    self._out.put_nowait(pb.GenerateResponse(delta=delta))
                if update.finish_reason is not None:
                    done = Completion(
                        rid, request.prompt_token_ids, tokens, update.text, update.finish_reason
                    )
                    self._out.put_nowait(completion_to_proto(done))
                    self._metrics.finished(update.finish_reason, len(tokens))
                    log.info("generated", tokens=len(tokens), versions=sorted(set(tokens.versions)),
                             finish_reason=update.finish_reason.value)  # fmt: skip
        except PipelineError as exc:
            if isinstance(exc, InvalidArgument):  # the engine names fields of the Submission
                exc = exc.under("submit")
            self._out.put_nowait(
                pb.GenerateResponse(error=pb.RequestError(request_id=rid, status=item_status(exc)))
            )
        except asyncio.CancelledError:
            aborted = Completion(rid, request.prompt_token_ids, tokens, "", FinishReason.ABORT)
            self._out.put_nowait(completion_to_proto(aborted))
            raise
        except Exception as exc:  # an engine bug must fail this request, not the stream
            log.exception("generation failed", request_id=rid)
            error = item_status(PipelineError(f"internal error: {exc}"))
            self._out.put_nowait(pb.GenerateResponse(error=pb.RequestError(request_id=rid, status=error)))


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, backend: InferenceBackend, metrics: InferenceMetrics | None = None) -> None:
        self._backend = backend
        self._metrics = metrics or InferenceMetrics(CollectorRegistry())
        self._draining = asyncio.Event()

    async def drain(self) -> None:
        """Stop accepting requests; streams end once their requests finish."""
        self._draining.set()

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        stream = _GenerateStream(self._backend, self._draining, self._metrics)
        async with contextlib.aclosing(stream.run(request_iterator)) as responses:
            async for response in responses:
                yield response

    async def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStatusResponse:
        return status_to_proto(self._backend.status(), self._backend.limits.max_running)


def registration(servicer: InferenceServicer) -> Registration:
    return Registration(
        pb.DESCRIPTOR.services_by_name["InferenceService"].full_name,
        lambda server: inference_pb2_grpc.add_InferenceServiceServicer_to_server(servicer, server),
    )
