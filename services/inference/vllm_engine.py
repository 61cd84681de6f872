"""The vLLM engine behind the servicer: vLLM's `AsyncLLM` in-process, wrapped to `InferenceBackend`.

    generate(req) ──validate──► AsyncLLM.generate(TokensPrompt, SamplingParams(DELTA, logprobs=0))
         ▲                              │ vLLM's own continuous batching, engine core process
         └── GenerationUpdate ◄── token ids + processed logprobs + weight version per token

    apply_weights(v, layout, buckets)  ── the receiver's verified buckets, one update at a time
         pause_generation(mode="keep", clear_cache=False)       running requests freeze, KV kept
         collective_rpc("pipelinerl_apply_weights") ── every worker verifies, then reload_weights
         update_weight_version(str(v))              ── the engine core stamps later steps with v
         resume_generation()                        ── the same requests continue on version v

Logprobs: `logprobs_mode="processed_logprobs"` makes vLLM report the sampled token's logprob under
the distribution it was drawn from (after temperature, top-k, top-p); for greedy requests vLLM
reports log_softmax of the unscaled logits. Both match the built-in engine's convention
(`pipelinerl.inference.sampling`).

Prefix cache: every prompt carries `cache_salt` = the weight version current when it arrives (the
incoming one during an update), so a request never reuses prompt KV computed by weights older than
those (the salt is part of vLLM's block hash), while requests of one version — a GRPO group, say —
still share their prompt's blocks. Running requests keep their own KV across an update, and so
does a request waiting in vLLM's queue for a row (`queue_ahead`): it may take its prompt's blocks
from the version it arrived under. Resetting the prefix cache instead would preempt running
requests (`reset_prefix_cache(reset_running_requests=True)`), which is what we avoid.

Pinned requests (`GenerationRequest.weight_version`), as in the built-in engine: one is admitted
only at the version held, under the lock every update holds, so never half-way through one. While
one runs, `apply_weights` makes its usual copy of the buckets (the bytes its workers load), keeps
it (a newer version replaces it), and returns at once, so that the receiver, and through it the
trainer's next broadcast, is never held up; the version is loaded when the last pinned request
ends. Costs: one host copy of a version in this process while it waits, and its workers' checks
run only when it is loaded, so a refusal then reaches no caller: it is logged, counted in
`failed_weight_updates`, and the old version stays until the next one.

Weight versions: vLLM's engine core stamps each step's outputs with the version set by
`update_weight_version`, and the final output of a request lists spans of output tokens per
version; the final update's versions come from those spans, so they are exact. Streamed deltas
(`stream_tokens`) are tagged with the version this backend holds when the delta arrives.

vLLM starts its engine core and workers with spawn: programs using this module must guard their
entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason, SamplingParams, TokenSequence, WeightVersion
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.model_info import describe_model
from pipelinerl.inference.pinning import PinnedWaits, check_pinned
from pipelinerl.inference.sequence import eos_token_ids
from pipelinerl.inference.stop import completion_text
from pipelinerl.inference.types import (
    GenerationRequest,
    GenerationUpdate,
    InferenceStatus,
    Limits,
    ModelInfo,
    tokens_from,
)
from pipelinerl.inference.validation import check_request
from pipelinerl.inference.vllm_worker import EXTENSION_CLASS, WireLayout, layout_to_wire
from pipelinerl.weights.types import WeightLayout

# vLLM lives in its own virtualenv (`make vllm-env`) and the type checker runs in the main one:
# hence `ignore[reportMissingImports]` on each vLLM import here.
if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm.v1.engine.async_llm import AsyncLLM  # pyright: ignore[reportMissingImports]

    from pipelinerl.weights.receiver import WeightReceiver

log = get_logger(__name__)

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_RATE_WINDOW_S = 10.0


@dataclass(frozen=True)
class _Waiting:
    """A version received while pinned requests run, as the bytes its workers will load."""

    version: WeightVersion
    wire: WireLayout
    data: list[bytes]


class VllmBackend:
    """Implements `InferenceBackend` (plus `apply_weights`, like `EngineRunner`) over vLLM's AsyncLLM."""

    def __init__(
        self,
        llm: AsyncLLM,
        tokenizer: PreTrainedTokenizerBase,
        limits: Limits,
        model_info: ModelInfo,
        *,
        weight_version: int = 0,
        run_id: str = "",
        ignore_eos: bool = False,
    ) -> None:
        self.llm = llm
        self.tokenizer = tokenizer
        self.run_id = run_id
        self.receiver: WeightReceiver | None = None
        """Set when the server follows a trainer; its counters are reported in `status()`."""
        self.last_stall_s = 0.0
        """Pause-to-resume time of the last update: what running requests waited."""
        self.on_swap: Callable[[float], None] | None = None
        """Called after each update with its `last_stall_s`."""
        self._limits = limits
        self._ignore_eos = ignore_eos
        self._version = weight_version
        self._salt_version = weight_version  # the version new requests will be scheduled under
        self._update_lock = asyncio.Lock()
        """Held through each update and each pinned request's admission."""
        self._pinned = 0
        """Pinned requests admitted and not finished."""
        self._waiting: _Waiting | None = None
        """Received while pinned requests run; loaded once none is left."""
        self._pinned_waits = PinnedWaits()
        self._deferred: set[asyncio.Task[None]] = set()
        """Loads of a waiting version, started as the last pinned request ended."""
        self._deferred_failures = 0
        """Waiting versions the workers refused when loaded: no caller saw those refusals."""
        self._live: set[str] = set()
        self._recent: deque[tuple[float, int]] = deque()
        self.model_info = model_info
        self._failed_updates = 0

    @classmethod
    async def create(cls, settings: EngineSettings, *, weight_version: int = 0) -> VllmBackend:
        """Start AsyncLLM on `settings.model` (a local HF directory, or a preset name, exported to a
        temporary directory first because vLLM loads only from disk). Must be awaited in the serving
        loop."""
        from transformers import AutoTokenizer, GenerationConfig
        from vllm.engine.arg_utils import AsyncEngineArgs  # pyright: ignore[reportMissingImports]
        from vllm.v1.engine.async_llm import AsyncLLM  # pyright: ignore[reportMissingImports]

        from pipelinerl.common.model import PRESETS, export_preset

        model, seed = settings.model, settings.seed
        path = model
        if model in PRESETS:
            # Kept for the process's lifetime: vLLM reads the directory again on reload from disk.
            path = str(export_preset(Path(tempfile.mkdtemp(prefix=f"pipelinerl-{model}-")), model, seed=seed))
        args = AsyncEngineArgs(
            model=path,
            tokenizer=path,
            dtype=settings.dtype,
            seed=seed,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_running,
            # The cache size as an engine argument, not VLLM_CPU_KVCACHE_SPACE: no process-wide env.
            kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30),
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION_CLASS,
            # Graph capture and compilation cost minutes on a small CPU and win little on tiny models.
            enforce_eager=True,
            disable_log_stats=True,
        )
        llm = AsyncLLM.from_engine_args(args)
        context = llm.model_config.max_model_len
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        try:
            generation = GenerationConfig.from_pretrained(path, local_files_only=True)
        except OSError:  # no generation_config.json: the tokenizer's EOS only
            generation = None
        info = describe_model(model, tokenizer, len(tokenizer), eos_token_ids(generation, tokenizer))
        limits = Limits(
            settings.max_running, min(settings.max_new_tokens, context), context, settings.queue_ahead
        )
        backend = cls(
            llm, tokenizer, limits, info, weight_version=weight_version, ignore_eos=settings.ignore_eos
        )
        await llm.update_weight_version(str(weight_version))
        return backend

    async def stop(self) -> None:
        for task in self._deferred:
            task.cancel()
        self.llm.shutdown()

    # ---- InferenceBackend ---------------------------------------------------------------------

    @property
    def limits(self) -> Limits:
        return self._limits

    @property
    def weight_version(self) -> int:
        return self._version

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        from vllm.inputs import TokensPrompt  # pyright: ignore[reportMissingImports]

        pinned = request.weight_version is not None
        if pinned:
            await self._pin(request)
        else:
            self._check(request)
        request_id = request.request_id
        self._live.add(request_id)
        tokens = TokenSequence()
        emitted = 0
        finished = False
        try:
            stream = self.llm.generate(
                TokensPrompt(
                    prompt_token_ids=list(request.prompt_token_ids), cache_salt=f"w{self._salt_version}"
                ),
                self._sampling_params(request.sampling),
                request_id,
            )
            async for output in stream:
                completion = output.outputs[0]
                version = self._version
                new_ids = list(completion.token_ids)
                tokens.token_ids += new_ids
                tokens.logprobs += _sampled_logprobs(completion.logprobs, new_ids)
                tokens.versions += [version] * len(new_ids)
                self._count(len(new_ids))
                if completion.finish_reason is None:
                    if request.stream_tokens and len(tokens) > emitted:
                        yield GenerationUpdate(request_id, tokens_from(tokens, emitted))
                        emitted = len(tokens)
                    continue
                finished = True
                if completion.weight_versions:
                    tokens.versions = _versions_from_spans(completion.weight_versions, tokens.versions)
                text = completion_text(self.tokenizer, tokens.token_ids, request.sampling.stop)
                reason = _FINISH_REASONS.get(completion.finish_reason, FinishReason.STOP)
                yield GenerationUpdate(request_id, tokens_from(tokens, emitted), reason, text)
                return
        except ValueError as exc:  # vLLM's input validation, for what check_request does not check
            raise InvalidArgument(str(exc)) from exc
        finally:
            self._live.discard(request_id)
            try:
                if not finished:  # the caller went away: free the request's cache in vLLM now
                    await self.llm.abort(request_id)
            finally:
                if pinned:
                    self._unpin()

    def status(self) -> InferenceStatus:
        running = self.llm.output_processor.get_num_unfinished_requests()
        return InferenceStatus(
            weight_version=WeightVersion(self._version, self.run_id),
            running=running,
            queued=0,  # vLLM's scheduler does not expose its waiting queue to the front end
            tokens_per_s=self._tokens_per_s(),
            weight_updates=self.receiver.stats.updates if self.receiver else 0,
            failed_weight_updates=self.receiver.stats.failed_updates + self._deferred_failures
            if self.receiver
            else self._failed_updates,
            engine="vllm",
            model_info=self.model_info,
            pinned_waits=self._pinned_waits.versions,
            pinned_wait_s=self._pinned_waits.seconds,
        )

    # ---- weight updates -----------------------------------------------------------------------

    async def apply_weights(
        self, version: WeightVersion, layout: WeightLayout, buckets: list[torch.Tensor]
    ) -> None:
        """Load one version given as byte buckets and their layout (the receiver's `ApplyWeights`);
        returns once every worker holds it, or at once while pinned requests run (the version then
        waits; see the module doc). The buckets cross into vLLM's engine process as bytes, as they
        are, and every worker checks them again before using them.

        Raises FailedPrecondition, and keeps serving the old version, if the version is not newer
        or any worker refuses it (bad checksum, unknown tensor, wrong shape)."""
        # Copies: the caller may reuse the buckets as soon as this returns, even if the version waits.
        wire = layout_to_wire(layout)
        data = [bucket.numpy().tobytes() for bucket in buckets]
        async with self._update_lock:
            newest = self._waiting.version if self._waiting else WeightVersion(self._version, self.run_id)
            if version.version <= newest.version and version.run_id == newest.run_id:
                raise FailedPrecondition(
                    f"weight version {version.version} is not newer than {newest.version}"
                )
            if self._pinned:
                self._waiting = _Waiting(version, wire, data)
                self._pinned_waits.began()
                log.info("weights staged behind pinned requests", weight_version=version.version,
                         held_version=self._version, pinned=self._pinned,
                         copied_bytes=sum(map(len, data)))  # fmt: skip
                return
            self._waiting = None  # an older one whose load has not started: this one supersedes it
            await self._load(version, wire, data)

    async def _load(self, version: WeightVersion, wire: WireLayout, data: list[bytes]) -> None:
        """Under the update lock: pause, load `version` into every worker, resume."""
        started = time.perf_counter()
        # Requests arriving from here on are first scheduled after resume, on the new weights.
        self._salt_version = version.version
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            await self.llm.collective_rpc("pipelinerl_apply_weights", args=(version.version, wire, data))
            await self.llm.update_weight_version(str(version.version))
            self._version = version.version
            self.run_id = version.run_id
        except Exception as exc:  # a worker refused the version; it left the model untouched
            self._salt_version = self._version
            self._failed_updates += 1
            log.error("vLLM refused a weight version; keeping the old one",
                      version=version.version, error=str(exc))  # fmt: skip
            raise FailedPrecondition(f"weight version {version.version} refused: {exc}") from exc
        finally:
            await self.llm.resume_generation()
            self.last_stall_s = time.perf_counter() - started
        log.info("weights swapped", weight_version=version.version, stall_s=round(self.last_stall_s, 4))
        if self.on_swap is not None:
            self.on_swap(self.last_stall_s)

    async def _pin(self, request: GenerationRequest) -> None:
        """Admit a pinned request: under the update lock, so the version it is checked against is
        the one every token it gets will carry."""
        async with self._update_lock:
            await self._load_waiting()  # one left waiting by the last pinned request goes first
            check_pinned(request.weight_version, self._version)
            self._check(request)
            self._pinned += 1

    def _unpin(self) -> None:
        self._pinned -= 1
        if self._pinned or self._waiting is None:
            return
        self._pinned_waits.ended()
        task = asyncio.create_task(self._load_waiting_locked())
        self._deferred.add(task)
        task.add_done_callback(self._deferred.discard)

    async def _load_waiting_locked(self) -> None:
        async with self._update_lock:
            await self._load_waiting()

    async def _load_waiting(self) -> None:
        """Under the update lock: load the version that waited, once no pinned request is left."""
        waiting = self._waiting
        if self._pinned or waiting is None:
            return
        self._waiting = None
        try:
            await self._load(waiting.version, waiting.wire, waiting.data)
        except FailedPrecondition:  # logged; the receiver took it for applied when it was staged
            self._deferred_failures += 1

    async def worker_versions(self) -> list[int | None]:
        """The version each vLLM worker last loaded (None: the checkpoint it started from)."""
        return list(await self.llm.collective_rpc("pipelinerl_weight_version"))

    # ---- helpers ------------------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSamplingParams  # pyright: ignore[reportMissingImports]
        from vllm.sampling_params import RequestOutputKind  # pyright: ignore[reportMissingImports]

        return VllmSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop) or None,
            stop_token_ids=list(params.stop_token_ids) or None,
            ignore_eos=self._ignore_eos,
            logprobs=0,  # only the sampled token's logprob
            output_kind=RequestOutputKind.DELTA,
            # Stop strings end the request but every sampled token stays (the trainer needs them);
            # the text is cut here, as the built-in engine does.
            include_stop_str_in_output=True,
        )

    def _check(self, request: GenerationRequest) -> None:
        check_request(request, self._limits, self.model_info.vocab_size, self.tokenizer)
        if request.request_id in self._live:
            raise InvalidArgument.field("request_id", f"{request.request_id!r} is already in use")

    def _count(self, n: int) -> None:
        now = time.monotonic()
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - _RATE_WINDOW_S:
            self._recent.popleft()

    def _tokens_per_s(self) -> float:
        if len(self._recent) < 2:
            return 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        return sum(n for _, n in self._recent) / span if span > 0 else 0.0


def _sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The sampled token's logprob at each new position (vLLM returns it even with logprobs=0)."""
    if logprobs is None:
        return [float("nan")] * len(token_ids)
    return [float(position[token].logprob) for position, token in zip(logprobs, token_ids, strict=True)]


def _versions_from_spans(spans: Any, fallback: list[int]) -> list[int]:
    versions = list(fallback)
    for span in spans:
        try:
            version = int(span.version)
        except ValueError:  # "default": a version label this backend did not set
            continue
        versions[span.start : span.end] = [version] * (span.end - span.start)
    return versions
