"""gRPC servicer of the inference server: the Generate stream's flow control and proto <-> domain
conversion around an `InferenceBackend`.

    client ──submit/cancel──► _GenerateStream ──► one task per request: backend.generate(...)
           ◄── capacity, deltas, completions, errors ── outbound queue ◄──┘
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator

import grpc
from prometheus_client import CollectorRegistry

from pipelinerl.common import convert, trace
from pipelinerl.common.errors import InvalidArgument, PipelineError, ResourceExhausted, Unavailable
from pipelinerl.common.log import bind_context, get_logger
from pipelinerl.common.server import Registration
from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.inference.convert import (
    capacity_to_proto,
    completion_to_proto,
    request_error_to_status,
    request_from_proto,
    status_to_proto,
)
from pipelinerl.inference.metrics import InferenceMetrics
from pipelinerl.inference.types import Completion, GenerationRequest, InferenceBackend
from pipelinerl.inference.v1 import inference_pb2 as pb
from pipelinerl.inference.v1 import inference_pb2_grpc

log = get_logger(__name__)

MAX_REQUEST_ID_BYTES = 128
PROMPTS_CACHED = 128
"""Prompt texts whose token ids the servicer keeps..."""
MAX_CACHED_PROMPT_CHARS = 16384
"""...each at most this long: a client's huge texts (refused as too long anyway) are not kept."""
MAX_BATCH_BYTES = 1 << 20
"""A `CompletionBatch` is closed at this size, well under gRPC's default 4 MiB message limit."""

_Outbound = pb.GenerateResponse | pb.Completion | Exception | None
"""What the stream sends next: a response; a bare completion of a request that came in a
`SubmissionBatch` (gathered into a `CompletionBatch`); None to end the stream; an exception to end
it with that error."""


class _GenerateStream:
    """State of one Generate call: requests in flight on it and the responses to send."""

    def __init__(
        self,
        backend: InferenceBackend,
        draining: asyncio.Event,
        metrics: InferenceMetrics,
        tokenize: Callable[[str], tuple[int, ...]],
    ) -> None:
        self._backend = backend
        self._tokenize = tokenize
        self._draining = draining
        self._metrics = metrics
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._batched: set[str] = set()
        """Requests in flight that came in a `SubmissionBatch`: their completions go out batched."""
        self._out: asyncio.Queue[_Outbound] = asyncio.Queue()

    async def run(
        self, requests: AsyncIterator[pb.GenerateRequest]
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        yield capacity_to_proto(self._backend.limits, self._backend.model_info, self._window())
        reader = asyncio.create_task(self._read(requests))
        drain_watch = asyncio.create_task(self._on_drain())
        try:
            while True:
                # Everything queued meanwhile goes out together: completions that finished in one
                # engine step share one message.
                queued = [await self._out.get()]
                while not self._out.empty():
                    queued.append(self._out.get_nowait())
                for response in _coalesce(queued):
                    if response is None:
                        return
                    if isinstance(response, Exception):
                        raise response
                    yield response
        finally:
            for task in (reader, drain_watch, *self._tasks.values()):
                task.cancel()

    def _window(self) -> int:
        return 0 if self._draining.is_set() else self._backend.limits.window

    async def _read(self, requests: AsyncIterator[pb.GenerateRequest]) -> None:
        try:
            async for request in requests:
                action = request.WhichOneof("action")
                if action == "submit":
                    self._submit(request.submit, "submit")
                elif action == "submit_batch":
                    for i, submission in enumerate(request.submit_batch.submissions):
                        self._submit(submission, f"submit_batch.submissions[{i}]", batched=True)
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

    def _submit(self, msg: pb.Submission, where: str, *, batched: bool = False) -> None:
        """Start one request; `where` is its place in the message, for the fields of an error."""
        request_id = msg.request_id
        try:
            request, ids = self._validate(msg, where), self._trace_ids(msg, where)
        except PipelineError as exc:
            error = pb.RequestError(request_id=request_id, status=request_error_to_status(exc))
            self._out.put_nowait(pb.GenerateResponse(error=error))
            return
        task = asyncio.create_task(self._generate(request, ids, where))
        self._tasks[request_id] = task
        if batched:
            self._batched.add(request_id)
        task.add_done_callback(lambda _: self._forget(request_id))

    def _forget(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)
        self._batched.discard(request_id)

    def _validate(self, msg: pb.Submission, where: str) -> GenerationRequest:
        if not msg.request_id or len(msg.request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise InvalidArgument.field(f"{where}.request_id", f"must be 1 to {MAX_REQUEST_ID_BYTES} bytes")
        if msg.request_id in self._tasks:
            raise InvalidArgument.field(f"{where}.request_id", "already in flight on this stream")
        if self._draining.is_set():
            raise Unavailable("server is shutting down")
        if len(self._tasks) >= self._backend.limits.window:
            raise ResourceExhausted(f"more than {self._backend.limits.window} requests in flight")
        if bool(msg.prompt_token_ids) == bool(msg.prompt_text):
            raise InvalidArgument.field(
                f"{where}.prompt_token_ids", "set exactly one of prompt_token_ids and prompt_text"
            )
        prompt = list(msg.prompt_token_ids or self._tokenize(msg.prompt_text))
        return request_from_proto(msg, prompt, where)

    @staticmethod
    def _trace_ids(msg: pb.Submission, where: str) -> dict[str, str]:
        """The ids the request's log lines carry: its `trace` map, its id as `sample_id` by default."""
        for key, value in msg.trace.items():
            if key not in trace.FIELDS:
                known = ", ".join(trace.FIELDS)
                raise InvalidArgument.field(f"{where}.trace", f"unknown key {key[:32]!r}: keys are {known}")
            if len(value.encode()) > MAX_REQUEST_ID_BYTES:
                raise InvalidArgument.field(f"{where}.trace[{key}]", f"at most {MAX_REQUEST_ID_BYTES} bytes")
        return {"sample_id": msg.request_id, **msg.trace}

    async def _generate(self, request: GenerationRequest, ids: dict[str, str], where: str) -> None:
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
                    self._complete(done)
                    self._metrics.finished(update.finish_reason, len(tokens))
                    log.debug("generated", tokens=len(tokens), versions=sorted(set(tokens.versions)),
                             finish_reason=update.finish_reason.value)  # fmt: skip
        except PipelineError as exc:
            if isinstance(exc, InvalidArgument):  # the engine names fields of the Submission
                exc = exc.under(where)
            error = pb.RequestError(request_id=rid, status=request_error_to_status(exc))
            self._out.put_nowait(pb.GenerateResponse(error=error))
        except asyncio.CancelledError:
            aborted = Completion(rid, request.prompt_token_ids, tokens, "", FinishReason.ABORT)
            self._complete(aborted)
            raise
        except Exception as exc:  # an engine bug must fail this request, not the stream
            log.exception("generation failed", request_id=rid)
            error = request_error_to_status(PipelineError(f"internal error: {exc}"))
            self._out.put_nowait(pb.GenerateResponse(error=pb.RequestError(request_id=rid, status=error)))

    def _complete(self, completion: Completion) -> None:
        message = completion_to_proto(completion)
        batched = completion.request_id in self._batched
        self._out.put_nowait(message if batched else pb.GenerateResponse(completion=message))


def _coalesce(queued: list[_Outbound]) -> Iterator[pb.GenerateResponse | Exception | None]:
    """`queued` in order, its bare completions gathered into `CompletionBatch` responses of at
    most MAX_BATCH_BYTES; a batch goes out before whatever ends the stream."""
    batch: list[pb.Completion] = []
    size = 0
    for item in queued:
        if isinstance(item, pb.Completion):
            item_size = item.ByteSize()
            if batch and size + item_size > MAX_BATCH_BYTES:
                yield pb.GenerateResponse(completions=pb.CompletionBatch(completions=batch))
                batch, size = [], 0
            batch.append(item)
            size += item_size
            continue
        if batch and not isinstance(item, pb.GenerateResponse):
            yield pb.GenerateResponse(completions=pb.CompletionBatch(completions=batch))
            batch, size = [], 0
        yield item
    if batch:
        yield pb.GenerateResponse(completions=pb.CompletionBatch(completions=batch))


def _tokenizer(backend: InferenceBackend) -> Callable[[str], tuple[int, ...]]:
    """`backend.tokenize`, with the last PROMPTS_CACHED short texts kept: the attempts of a group
    share one prompt and arrive together, so it is tokenized once."""
    cached = functools.lru_cache(maxsize=PROMPTS_CACHED)(lambda text: tuple(backend.tokenize(text)))

    def tokenize(text: str) -> tuple[int, ...]:
        return cached(text) if len(text) <= MAX_CACHED_PROMPT_CHARS else tuple(backend.tokenize(text))

    return tokenize


class InferenceServicer(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, backend: InferenceBackend, metrics: InferenceMetrics | None = None) -> None:
        self._backend = backend
        self._metrics = metrics or InferenceMetrics(CollectorRegistry())
        self._draining = asyncio.Event()
        self._tokenize = _tokenizer(backend)

    async def drain(self) -> None:
        """Stop accepting requests; streams end once their requests finish."""
        self._draining.set()

    async def Generate(
        self, request_iterator: AsyncIterator[pb.GenerateRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        stream = _GenerateStream(self._backend, self._draining, self._metrics, self._tokenize)
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
