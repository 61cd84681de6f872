"""The built-in inference engine: continuous batching over an HF causal LM, as a pure loop.

There is no grpc, no thread and no event loop in here (vLLM v1 style): the server wraps `step()` in
its own loop and routes the outputs; tests drive it directly.

    add_request ──► validate ──► queue (≤ max_queued) ─┐
    abort ────────► pending aborts ────────────────────┤        (under a lock: any thread)
    stage_weights ─► validate ──► staged (version v+1) ─┤
                                                       ▼
    step()  1. swap staged weights into the model, in place: running sequences keep their KV
               cache and continue on the new weights; later tokens carry the new version
            2. apply aborts: their rows leave the batch, the cache row is freed
            3. decode: ONE forward over all running rows (1 token each), sample, +1 token per row
            4. admit newcomers into free rows (≤ max_running, ≤ max_prefill_tokens) and prefill
               them in ONE left-padded forward; their first token comes from it, so they join
               the decode batch at the next step
            5. finished rows leave (stop token, stop string, max_new_tokens) and the last row
               moves into each hole, so running rows are always 0..n-1
            A decode or prefill that raises is retried one request at a time; a request that still
            fails, or whose logits are NaN/inf, ends with a `FailedUpdate` and the others go on.
                                                       │
                                                       ▼
    list[GenerationUpdate]: the final update of each finished request, plus per-step deltas for
    `stream_tokens` requests; every token carries its logprob and the weight version that made it.

KV cache ("slot" cache): per layer, one K and one V buffer [max_running, kv_heads, capacity,
head_dim]. Row r belongs to the r-th running sequence and cache index == token position, so decode
writes one column per row and attends to rows [:n] up to the longest sequence, masked per row.
`capacity` grows by doubling up to the context length. The model is called with explicit
position ids and a 4D additive mask, so its own mask construction and cache bookkeeping are bypassed.

Stop strings: the completion is detokenized incrementally; when a stop string appears the request
finishes with reason `stop`. Its tokens are NOT trimmed (the trainer needs every sampled token and
its logprob); only the final update's `text` is cut before the earliest stop string. Stop tokens
(EOS, `stop_token_ids`) are kept in the tokens too; `text` is decoded without special tokens, so
EOS does not show in it.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, CacheLayerMixin

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason, SamplingParams, TokenSequence
from pipelinerl.inference.sampling import make_generator, sample
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate, Limits

log = get_logger(__name__)

MAX_TEMPERATURE = 100.0


@dataclass
class FailedUpdate(GenerationUpdate):
    """The final update (finish reason `abort`) of a request the engine could not continue."""

    error: str = ""


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 64
    """Sequences decoded together (rows of the KV cache)."""
    max_queued: int = 1024
    """Requests waiting for a row; beyond this `add_request` raises ResourceExhausted."""
    max_model_len: int | None = None
    """Context length (prompt + completion); None means the model's max_position_embeddings."""
    max_new_tokens: int = 4096
    """The largest `max_new_tokens` a request may ask for."""
    max_prefill_tokens: int = 8192
    """Padded prompt tokens prefilled in one step, so newcomers stall the running batch only
    briefly; a single prompt is always admitted."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks, fixed-length rollouts); explicit
    `stop_token_ids` still stop."""


@dataclass(frozen=True)
class EngineStats:
    running: int
    queued: int
    max_running: int
    max_queued: int
    weight_version: int
    generated_tokens: int
    """Since the engine started."""
    tokens_per_s: float
    """Tokens generated over the compute time of the last steps."""
    last_swap_s: float
    """How long the last weight swap held up decoding (the copy into the parameters)."""


class InferenceEngine:
    """Continuous batching over `model`. `add_request`, `abort`, `stage_weights` and `stats` may be
    called from any thread; `step` from one thread at a time."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: EngineConfig | None = None,
        *,
        weight_version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.max_model_len = self.config.max_model_len or model.config.max_position_embeddings
        _check_attention_window(model, self.max_model_len)
        self._vocab_size = model.get_output_embeddings().weight.shape[0]
        self._eos_ids = _eos_token_ids(model, tokenizer)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._cache = _SlotKVCache(model.config.num_hidden_layers, self.config.max_running)
        self._version = weight_version
        self._lock = threading.Lock()
        self._queue: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._live_ids: set[str] = set()
        self._aborts: set[str] = set()
        self._staged: dict[str, torch.Tensor] = {}
        self._staged_version: int | None = None
        self._generated = 0
        self._recent_steps: deque[tuple[int, float]] = deque(maxlen=64)
        self._last_swap_s = 0.0

    # ---- inputs (any thread) ------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        """Queue `request`; raises InvalidArgument for a bad request, ResourceExhausted when full."""
        self._validate(request)
        sequence = _Sequence.start(
            request, self._stop_ids(request.sampling), self.tokenizer, self.model.device
        )
        with self._lock:
            if request.request_id in self._live_ids:
                raise InvalidArgument.field("request_id", f"{request.request_id!r} is already in use")
            if len(self._queue) >= self.config.max_queued:
                raise ResourceExhausted(f"the queue holds its maximum of {self.config.max_queued} requests")
            self._queue.append(sequence)
            self._live_ids.add(request.request_id)

    def abort(self, request_id: str) -> bool:
        """Abort a queued or running request; the next `step` frees its row and returns its final
        update (finish reason `abort`, with the tokens generated so far). False when the request is
        unknown or already finished."""
        with self._lock:
            if request_id not in self._live_ids or request_id in self._aborts:
                return False
            self._aborts.add(request_id)
            return True

    def stage_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Stage weights of `version`; the next `step` copies them into the model before it decodes.

        One call is one atomic update: pass every tensor of the version together (a subset updates
        only those parameters). The tensors are kept by reference until the swap, so the caller must
        not modify them meanwhile.
        """
        tensors = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        self._validate_weights(tensors)
        with self._lock:
            newest = self._version if self._staged_version is None else self._staged_version
            if version <= newest:
                raise FailedPrecondition(f"weight version {version} is not newer than version {newest}")
            self._staged.update(tensors)
            self._staged_version = version

    # ---- the loop -----------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._queue or self._aborts)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def limits(self) -> Limits:
        return Limits(self.config.max_running, self.config.max_new_tokens, self.max_model_len)

    def stats(self) -> EngineStats:
        """Safe from any thread."""
        recent = list(self._recent_steps)  # one C-level copy: step() may append meanwhile
        tokens = sum(n for n, _ in recent)
        seconds = sum(s for _, s in recent)
        return EngineStats(
            running=len(self._running),
            queued=len(self._queue),
            max_running=self.config.max_running,
            max_queued=self.config.max_queued,
            weight_version=self._version,
            generated_tokens=self._generated,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            last_swap_s=self._last_swap_s,
        )

    @torch.no_grad()
    def step(self) -> list[GenerationUpdate]:
        """Swap staged weights, apply aborts, decode the running batch once, prefill newcomers."""
        started = time.perf_counter()
        generated_before = self._generated
        self._swap_staged_weights()
        outputs = self._apply_aborts()
        if self._running:
            self._isolated(self._decode, list(range(len(self._running))))
        newcomers = self._admit()
        if newcomers:
            self._running.extend(newcomers)
            self._isolated(
                self._prefill, list(range(len(self._running) - len(newcomers), len(self._running)))
            )
        outputs += self._collect_updates()
        self._recent_steps.append((self._generated - generated_before, time.perf_counter() - started))
        return outputs

    def _swap_staged_weights(self) -> None:
        with self._lock:
            staged, self._staged = self._staged, {}
            if self._staged_version is None:
                return
            version, self._staged_version = self._staged_version, None
            self._version = version
        started = time.perf_counter()
        for name, tensor in staged.items():
            self._params[name].copy_(tensor)
        count = len(staged)
        del staged  # the last reference to the received buffers: freeing them is part of the hold-up
        self._last_swap_s = time.perf_counter() - started
        log.info(
            "weights swapped",
            weight_version=version,
            tensors=count,
            seconds=round(self._last_swap_s, 4),
        )

    def _apply_aborts(self) -> list[GenerationUpdate]:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            queued = [s for s in self._queue if s.request.request_id in aborts]
            self._queue = deque(s for s in self._queue if s.request.request_id not in aborts)
        running = [s for s in self._running if s.request.request_id in aborts]
        self._release([row for row, s in enumerate(self._running) if s.request.request_id in aborts])
        return [self._final_update(s, FinishReason.ABORT) for s in queued + running]

    def _admit(self) -> list[_Sequence]:
        free_rows = self.config.max_running - len(self._running)
        admitted: list[_Sequence] = []
        longest = 0
        with self._lock:
            while self._queue and len(admitted) < free_rows:
                padded_longest = max(longest, len(self._queue[0].request.prompt_token_ids))
                if admitted and padded_longest * (len(admitted) + 1) > self.config.max_prefill_tokens:
                    break
                admitted.append(self._queue.popleft())
                longest = padded_longest
        return admitted

    def _isolated(self, run: Callable[[list[int]], None], rows: list[int]) -> None:
        """`run(rows)`; if it raises, each row again on its own, and a row that still fails ends its
        request with the error: one bad request must not fail those batched with it. Rerunning is
        safe since a forward rewrites the same cache entries and sampling happens only after it."""
        try:
            run(rows)
        except Exception as exc:
            if len(rows) > 1:
                log.warning("batched step failed; retrying its requests one by one", error=repr(exc))
                for row in rows:
                    if self._running[row].finish_reason is None:  # it may have ended before the error
                        self._isolated(run, [row])
            else:
                self._fail(self._running[rows[0]], repr(exc))

    def _fail(self, sequence: _Sequence, error: str) -> None:
        log.error("request failed in the engine", request_id=sequence.request.request_id, error=error)
        sequence.finish_reason = FinishReason.ABORT
        sequence.error = error

    def _decode(self, rows: list[int]) -> None:
        """One token for each of these running rows, in one forward of q_len 1."""
        sequences = [self._running[row] for row in rows]
        device = self.model.device
        positions = torch.tensor([s.next_position for s in sequences], device=device)
        kv_len = int(positions.max()) + 1
        keys = torch.arange(kv_len, device=device)
        allowed = (keys[None, :] <= positions[:, None])[:, None, None, :]
        # All rows (the usual case) are 0..n-1 and read as a view; a subset reads a copy.
        everyone = len(rows) == len(self._running)
        plan = _CachePlan(
            rows=torch.tensor(rows, device=device),
            positions=positions,
            real=torch.ones(len(rows), 1, dtype=torch.bool, device=device),
            capacity=self._capacity_for(kv_len),
            read=(slice(0, len(rows)) if everyone else torch.tensor(rows, device=device), kv_len),
        )
        input_ids = torch.tensor([[s.tokens.token_ids[-1]] for s in sequences], device=device)
        logits = self._forward(input_ids, positions[:, None], allowed, plan)
        self._append_sampled(sequences, logits)

    def _prefill(self, rows: list[int]) -> None:
        """Prompts of these running rows (not yet prefilled), left-padded to the longest one, so the
        last column holds every row's next-token logits; the cache stores each prompt from index 0
        (padding is never written)."""
        newcomers = [self._running[row] for row in rows]
        device = self.model.device
        lengths = torch.tensor([len(s.request.prompt_token_ids) for s in newcomers], device=device)
        width = int(lengths.max())
        starts = width - lengths
        input_ids = torch.full((len(newcomers), width), self._pad_id, device=device)
        for row, sequence in enumerate(newcomers):
            input_ids[row, int(starts[row]) :] = torch.tensor(sequence.request.prompt_token_ids)
        columns = torch.arange(width, device=device)
        real = columns[None, :] >= starts[:, None]
        positions = (columns[None, :] - starts[:, None]).clamp(min=0)
        causal = columns[None, :] <= columns[:, None]
        allowed = (causal[None, :, :] & real[:, None, :])[:, None]
        plan = _CachePlan(
            rows=torch.tensor(rows, device=device)[:, None].expand(-1, width)[real],
            positions=positions[real],
            real=real,
            capacity=self._capacity_for(width),
            read=None,
        )
        logits = self._forward(input_ids, positions, allowed, plan)
        self._append_sampled(newcomers, logits)

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor, plan: _CachePlan
    ) -> torch.Tensor:
        """Next-token logits [batch, vocab] at the last column of `input_ids`."""
        # Additive mask with the dtype's minimum rather than -inf: a padding query that may see no
        # key at all then gets a uniform (ignored) attention instead of NaN.
        blocked = torch.finfo(self.model.dtype).min
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, blocked)
        self._cache.plan = plan
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _append_sampled(self, sequences: list[_Sequence], logits: torch.Tensor) -> None:
        params = [s.request.sampling for s in sequences]
        sampled = sample(logits, params, [s.generator for s in sequences])
        for sequence, token, logprob, valid in zip(
            sequences,
            sampled.token_ids.tolist(),
            sampled.logprobs.tolist(),
            sampled.valid.tolist(),
            strict=True,
        ):
            if valid:
                sequence.append(token, logprob, self._version)
                self._generated += 1
            else:
                self._fail(sequence, "the model's logits are NaN or infinite")

    def _collect_updates(self) -> list[GenerationUpdate]:
        outputs = []
        finished_rows = []
        for row, sequence in enumerate(self._running):
            if sequence.finish_reason is not None:
                outputs.append(self._final_update(sequence, sequence.finish_reason))
                finished_rows.append(row)
            elif sequence.request.stream_tokens:
                outputs.append(sequence.delta())
        self._release(finished_rows)
        return outputs

    def _release(self, rows: list[int]) -> None:
        """Remove rows from the batch; the last row moves into each hole so rows stay contiguous."""
        for row in sorted(rows, reverse=True):
            last = len(self._running) - 1
            if row != last:
                self._cache.move_row(last, row, self._running[last].next_position)
                self._running[row] = self._running[last]
            self._running.pop()

    def _final_update(self, sequence: _Sequence, reason: FinishReason) -> GenerationUpdate:
        request = sequence.request
        with self._lock:
            self._live_ids.discard(request.request_id)
        text = self.tokenizer.decode(sequence.tokens.token_ids, skip_special_tokens=True)
        update = sequence.delta()
        if sequence.error is not None:
            update = FailedUpdate(update.request_id, update.tokens, error=sequence.error)
        update.finish_reason = reason
        update.text = _cut_at_stop_string(text, request.sampling.stop)
        log.debug("request finished", request_id=request.request_id, finish_reason=reason.value)
        return update

    def _capacity_for(self, length: int) -> int:
        """Cache length to allocate for `length` positions: doubling keeps regrowth rare."""
        return min(max(64, 1 << (length - 1).bit_length()), self.max_model_len)

    @property
    def _pad_id(self) -> int:
        return self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    # ---- validation ---------------------------------------------------------------------------

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        return frozenset(params.stop_token_ids) | (frozenset() if self.config.ignore_eos else self._eos_ids)

    def _validate(self, request: GenerationRequest) -> None:
        if not request.request_id:
            raise InvalidArgument.field("request_id", "must not be empty")
        prompt = request.prompt_token_ids
        if not prompt:
            raise InvalidArgument.field("prompt_token_ids", "must not be empty")
        self._validate_token_ids("prompt_token_ids", prompt)
        if len(prompt) >= self.max_model_len:
            raise InvalidArgument.field(
                "prompt_token_ids",
                f"{len(prompt)} tokens leave no room in the context of {self.max_model_len} tokens",
            )
        self._validate_sampling(request.sampling, len(prompt))

    def _validate_sampling(self, params: SamplingParams, prompt_len: int) -> None:
        prefix = "sampling."
        if not 0 <= params.temperature <= MAX_TEMPERATURE:  # also rejects NaN
            raise InvalidArgument.field(
                prefix + "temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy)"
            )
        if not 0 < params.top_p <= 1:
            raise InvalidArgument.field(prefix + "top_p", "must be in (0, 1]")
        if params.top_k < 0:
            raise InvalidArgument.field(prefix + "top_k", "must be >= 0 (0 disables it)")
        self._validate_max_new_tokens(params.max_new_tokens, prompt_len)
        self._validate_token_ids(prefix + "stop_token_ids", params.stop_token_ids)
        for i, stop in enumerate(params.stop):
            self._validate_stop_string(f"{prefix}stop[{i}]", stop)

    def _validate_max_new_tokens(self, max_new_tokens: int, prompt_len: int) -> None:
        name = "sampling.max_new_tokens"
        if max_new_tokens < 1:
            raise InvalidArgument.field(name, "must be >= 1")
        if max_new_tokens > self.config.max_new_tokens:
            raise InvalidArgument.field(name, f"exceeds this server's limit of {self.config.max_new_tokens}")
        if prompt_len + max_new_tokens > self.max_model_len:
            raise InvalidArgument.field(
                name,
                f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the context of "
                f"{self.max_model_len} tokens",
            )

    def _validate_token_ids(self, name: str, token_ids: Iterable[int]) -> None:
        for i, token in enumerate(token_ids):
            if not 0 <= token < self._vocab_size:
                raise InvalidArgument.field(
                    f"{name}[{i}]", f"token id {token} is outside the vocabulary [0, {self._vocab_size})"
                )

    def _validate_stop_string(self, name: str, stop: str) -> None:
        if not stop:
            raise InvalidArgument.field(name, "must not be empty")
        ids = self.tokenizer.encode(stop, add_special_tokens=False)
        unk = self.tokenizer.unk_token_id
        if not ids or (unk is not None and unk in ids):
            raise InvalidArgument.field(name, f"{stop!r} cannot be tokenized, so it can never be generated")

    def _validate_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            if name not in self._params:
                raise InvalidArgument.field(f"named_tensors[{name}]", "the model has no such parameter")
            expected = tuple(self._params[name].shape)
            if tuple(tensor.shape) != expected:
                raise InvalidArgument.field(
                    f"named_tensors[{name}]", f"shape {tuple(tensor.shape)} != the model's {expected}"
                )


@dataclass(eq=False)
class _Sequence:
    """A request's decoding state. Its cache row is its index in the engine's running list."""

    request: GenerationRequest
    stop_ids: frozenset[int]
    generator: torch.Generator
    watcher: _StopStringWatcher | None
    tokens: TokenSequence = field(default_factory=TokenSequence)
    emitted: int = 0
    """Tokens already handed out in updates."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    """Why the engine could not continue it (it then finishes with `abort`)."""

    @classmethod
    def start(
        cls,
        request: GenerationRequest,
        stop_ids: frozenset[int],
        tokenizer: PreTrainedTokenizerBase,
        device: torch.device,
    ) -> _Sequence:
        params = request.sampling
        watcher = _StopStringWatcher(tokenizer, params.stop) if params.stop else None
        # On the logits' device, which torch.multinomial requires of its generator.
        return cls(request, stop_ids, make_generator(params.seed, device), watcher)

    @property
    def next_position(self) -> int:
        """Position of the last sampled token, the one not yet in the cache."""
        return len(self.request.prompt_token_ids) + len(self.tokens) - 1

    def append(self, token: int, logprob: float, version: int) -> None:
        self.tokens.token_ids.append(token)
        self.tokens.logprobs.append(logprob)
        self.tokens.versions.append(version)
        if token in self.stop_ids or (self.watcher is not None and self.watcher.push(self.tokens.token_ids)):
            self.finish_reason = FinishReason.STOP
        elif len(self.tokens) >= self.request.sampling.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH

    def delta(self) -> GenerationUpdate:
        """The tokens not yet handed out, as a non-final update."""
        start, self.emitted = self.emitted, len(self.tokens)
        new = TokenSequence(
            self.tokens.token_ids[start:], self.tokens.logprobs[start:], self.tokens.versions[start:]
        )
        return GenerationUpdate(self.request.request_id, new)


class _StopStringWatcher:
    """Detokenizes a completion incrementally and reports when a stop string appears in it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._keep = max(len(stop) for stop in stops) - 1
        self._tail = ""
        # Decoding tokens[prefix:read] again as context keeps tokenizers that merge across token
        # boundaries (leading spaces, multi-byte characters) from producing different text.
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> bool:
        context = self._decode(token_ids[self._prefix : self._read])
        text = self._decode(token_ids[self._prefix :])
        # A token that ends inside a multi-byte character decodes to U+FFFD: wait for the rest.
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return False
        window = self._tail + text[len(context) :]
        self._prefix, self._read = self._read, len(token_ids)
        self._tail = window[max(0, len(window) - self._keep) :]
        return any(stop in window for stop in self._stops)

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)


def _cut_at_stop_string(text: str, stops: tuple[str, ...]) -> str:
    cuts = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


@dataclass(frozen=True)
class _CachePlan:
    """Where the coming forward writes its keys and values, and what its attention reads back."""

    rows: torch.Tensor
    """[tokens] cache row of each real (non-padding) input token"""
    positions: torch.Tensor
    """[tokens] its position, which is also its cache index"""
    real: torch.Tensor
    """[batch, q_len] bool: which input slots are real tokens"""
    capacity: int
    """cache length the buffers must have"""
    read: tuple[slice | torch.Tensor, int] | None
    """(rows, kv_len) to attend to; None for a prefill, which attends only to its own fresh keys"""


class _SlotKVCache(Cache):
    """One cache row per running sequence, cache index == position; see the module docstring."""

    def __init__(self, num_layers: int, max_rows: int) -> None:
        self.max_rows = max_rows
        self.plan: _CachePlan | None = None
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])

    def move_row(self, source: int, target: int, length: int) -> None:
        for layer in self.layers:
            layer.move_row(source, target, length)


class _SlotLayer(CacheLayerMixin):
    def __init__(self, owner: _SlotKVCache) -> None:
        super().__init__()
        self._owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.keys = self._allocate(key_states, self._owner.plan.capacity)
        self.values = self._allocate(value_states, self._owner.plan.capacity)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._owner.plan
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif self.keys.shape[2] < plan.capacity:
            self.keys = self._grow(self.keys, plan.capacity)
            self.values = self._grow(self.values, plan.capacity)
        # [batch, heads, q, dim] -> [tokens, heads, dim], in the same order as plan.rows/positions
        self.keys[plan.rows, :, plan.positions] = key_states.transpose(1, 2)[plan.real]
        self.values[plan.rows, :, plan.positions] = value_states.transpose(1, 2)[plan.real]
        if plan.read is None:
            return key_states, value_states
        rows, kv_len = plan.read
        return self.keys[rows, :, :kv_len], self.values[rows, :, :kv_len]

    def move_row(self, source: int, target: int, length: int) -> None:
        self.keys[target, :, :length] = self.keys[source, :, :length]
        self.values[target, :, :length] = self.values[source, :, :length]

    def _allocate(self, states: torch.Tensor, capacity: int) -> torch.Tensor:
        _, heads, _, dim = states.shape
        return states.new_zeros(self._owner.max_rows, heads, capacity, dim)

    def _grow(self, buffer: torch.Tensor, capacity: int) -> torch.Tensor:
        grown = buffer.new_zeros(buffer.shape[0], buffer.shape[1], capacity, buffer.shape[3])
        grown[:, :, : buffer.shape[2]] = buffer
        return grown

    # The engine passes position ids and a ready 4D mask, so models never ask the cache for sizes;
    # failing loudly beats answering with a number that is wrong for some rows.
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("the slot cache needs explicit position ids and a 4D attention mask")

    def get_seq_length(self) -> int:
        raise NotImplementedError("the slot cache needs explicit position ids and a 4D attention mask")

    def get_max_length(self) -> int:
        return -1


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from the generation config (may be a list) and the tokenizer."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {configured} if isinstance(configured, int) else set(configured or ())
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def _check_attention_window(model: PreTrainedModel, max_model_len: int) -> None:
    # The engine gives every layer one full causal mask; a sliding-window layer would silently
    # attend beyond its window once a sequence outgrows it.
    window = getattr(model.config, "sliding_window", None)
    if window is not None and window < max_model_len:
        raise ValueError(
            f"the built-in engine has no sliding-window attention: set max_model_len <= {window}, "
            f"the model's window (it is {max_model_len})"
        )
