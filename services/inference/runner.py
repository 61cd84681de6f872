"""The built-in engine behind the servicer: a thread that steps the engine, and asyncio plumbing
that routes each step's updates to the request that owns them.

    generate(req) ──add_request──► InferenceEngine ◄──stage_weights── apply_weights(v, layout, buckets)
         ▲                              │ step() in the engine thread (wakes on new work)
         └── per-request queue ◄── outbox ◄── each step's updates
                                  (one wake-up of the event loop delivers every step's updates
                                   posted since the last delivery ran)

`apply_weights` returns once the engine lets go of the receiver's buffers: after the swap, or at
once when the version waits behind pinned requests (the engine then holds a host copy of it).

Closing a `generate` iterator early (client cancel, stream gone) aborts the request in the engine,
which frees its cache row at the next step. A request the engine fails raises INTERNAL for that
request only; a step that raises stops the engine for good: every request fails with UNAVAILABLE
and `on_failure` runs (the server reports NOT_SERVING).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import AsyncIterator, Awaitable, Callable

import torch

from pipelinerl.common.errors import PipelineError, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import WeightVersion
from pipelinerl.inference.engine import FailedUpdate, InferenceEngine
from pipelinerl.inference.model_info import describe_model
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate, InferenceStatus, Limits
from pipelinerl.weights import buckets as bucketing
from pipelinerl.weights.receiver import WeightReceiver
from pipelinerl.weights.types import WeightLayout

log = get_logger(__name__)


class EngineRunner:
    """Implements `InferenceBackend` over an `InferenceEngine`."""

    def __init__(self, engine: InferenceEngine, model_name: str, run_id: str = "") -> None:
        self.engine = engine
        self.model_info = describe_model(
            model_name, engine.tokenizer, engine.vocab_size, engine.eos_token_ids
        )
        self.run_id = run_id
        self.receiver: WeightReceiver | None = None
        """Set when the server follows a trainer; its counters are reported in `status()`."""
        self.on_failure: Callable[[Exception], Awaitable[None]] | None = None
        """Awaited, in the event loop, once the engine loop has died."""
        self.on_swap: Callable[[float], None] | None = None
        """Called, in the event loop, after each swap with how long it held up decoding."""
        self._queues: dict[str, asyncio.Queue[GenerationUpdate | Exception]] = {}
        self._failure: Exception | None = None
        self._version = engine.weight_version
        self._swapped = asyncio.Event()  # set, in the event loop, whenever the engine's version changes
        self._wake = threading.Event()
        self._outbox: list[GenerationUpdate] = []
        """Updates the engine thread posted that the event loop has not delivered yet."""
        self._outbox_lock = threading.Lock()
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._failing: concurrent.futures.Future[None] | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    @property
    def limits(self) -> Limits:
        return self.engine.limits

    def tokenize(self, text: str) -> list[int]:
        return list(self.engine.tokenizer(text)["input_ids"])

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        if self._failure is not None:
            raise Unavailable(f"the engine failed: {self._failure}")
        queue: asyncio.Queue[GenerationUpdate | Exception] = asyncio.Queue()
        self.engine.add_request(request)  # raises InvalidArgument before any update
        self._queues[request.request_id] = queue
        self._wake_engine()
        finished = False
        try:
            while not finished:
                update = await queue.get()
                if isinstance(update, Exception):
                    raise Unavailable(f"the engine failed: {update}")
                if isinstance(update, FailedUpdate):
                    finished = True  # the engine has already let go of it
                    raise PipelineError(f"generation failed: {update.error}")
                finished = update.finish_reason is not None
                yield update
        finally:
            del self._queues[request.request_id]
            if not finished:
                self.engine.abort(request.request_id)
                self._wake_engine()

    def _wake_engine(self) -> None:
        # Setting an Event takes its lock and notifies; a burst of requests needs it once.
        if not self._wake.is_set():
            self._wake.set()

    async def apply_weights(
        self, version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]
    ) -> None:
        """The receiver's `ApplyWeights`: stage a verified version and return once the engine no
        longer reads the buckets, so the caller may reuse their memory: after the swap (between two
        decode steps), or at once while pinned requests are queued or running, the version then
        waiting as a host copy until the last of them ends (`InferenceEngine.stage_weights`), so
        that a receiver in a broadcast group never holds up the trainer's next broadcast."""
        tensors = bucketing.unpack(layout, buckets)
        # In a thread: behind pinned requests the engine copies the version here.
        borrowed = await asyncio.to_thread(self.engine.stage_weights, tensors, version.version)
        self.run_id = version.run_id
        self._wake.set()
        while borrowed and self._failure is None and self._version < version.version:
            self._swapped.clear()
            await self._swapped.wait()
        if self._failure is not None:
            raise Unavailable(f"the engine failed: {self._failure}")

    def status(self) -> InferenceStatus:
        stats = self.engine.stats()
        return InferenceStatus(
            weight_version=WeightVersion(stats.weight_version, self.run_id),
            running=stats.running,
            queued=stats.queued,
            tokens_per_s=stats.tokens_per_s,
            weight_updates=self.receiver.stats.updates if self.receiver else 0,
            failed_weight_updates=self.receiver.stats.failed_updates if self.receiver else 0,
            engine="builtin",
            model_info=self.model_info,
            decode_steps=stats.decode_steps,
            decoded_rows=stats.decoded_rows,
            pinned_waits=stats.pinned_waits,
            pinned_wait_s=stats.pinned_wait_s,
            prefill_tokens=stats.prefill_tokens,
            reused_prompt_tokens=stats.reused_prompt_tokens,
            kept_caches=stats.kept_caches,
        )

    def _run(self) -> None:
        assert self._loop is not None
        posted = self._version  # the version the event loop was last told of
        while not self._stopped.is_set():
            self._wake.wait()
            self._wake.clear()
            while not self._stopped.is_set():
                try:
                    updates = self.engine.step()  # also swaps staged weights when idle
                except Exception as exc:  # a broken engine fails every request rather than hang them
                    log.exception("engine step failed; the engine is stopped")
                    # Kept, since it holds the task and the event loop keeps only weak references.
                    self._failing = asyncio.run_coroutine_threadsafe(self._fail_all(exc), self._loop)
                    return
                if updates:
                    self._post(updates)
                if self.engine.weight_version != posted:
                    posted = self.engine.weight_version
                    stall_s = self.engine.stats().last_swap_s
                    self._loop.call_soon_threadsafe(self._on_swapped, posted, stall_s)
                if not self.engine.has_work:
                    break

    async def _fail_all(self, exc: Exception) -> None:
        self._failure = exc
        for queue in self._queues.values():
            queue.put_nowait(exc)
        self._swapped.set()
        if self.on_failure is not None:
            await self.on_failure(exc)

    def _on_swapped(self, version: int, stall_s: float) -> None:
        self._version = version
        self._swapped.set()
        if self.on_swap is not None:
            self.on_swap(stall_s)

    def _post(self, updates: list[GenerationUpdate]) -> None:
        """In the engine thread: queue a step's updates, and wake the event loop unless a delivery
        is already waiting to run there (it takes these too)."""
        assert self._loop is not None
        with self._outbox_lock:
            waiting = bool(self._outbox)
            self._outbox += updates
        if not waiting:
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._outbox_lock:
            updates, self._outbox = self._outbox, []
        for update in updates:
            queue = self._queues.get(update.request_id)
            if queue is not None:  # None: the caller went away and the request was aborted
                queue.put_nowait(update)
