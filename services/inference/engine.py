"""The built-in inference engine: continuous batching over an HF causal LM, as a pure loop.

There is no grpc, no thread and no event loop in here (vLLM v1 style): the server wraps `step()` in
its own loop and routes the outputs; tests drive it directly.

    add_request ──► validate ──► queue (≤ max_queued) ─┐
    abort ────────► pending aborts ────────────────────┤        (under a lock: any thread)
    stage_weights ─► validate ──► next (version v+1) ──┤
                            └───► waiting, while pinned requests run (copies; see below)
                                                       ▼
    step()  1. swap the next version into the model, in place: running sequences keep their KV
               cache and continue on the new weights; later tokens carry the new version. One copy
               per received bucket (`flat_weights`): the parameters live in flat buffers laid out
               like the buckets, from the first version on
            2. apply aborts: their rows leave the batch, the cache row is freed
            3. decode: ONE forward over all running rows (1 token each), draw, +1 token per row
            4. admit newcomers into free rows (≤ max_running, ≤ max_prefill_tokens) and prefill
               them in ONE left-padded forward, each distinct prompt once (a group's attempts share
               theirs); their first token comes from it, so they join the decode batch next step.
               A newcomer whose prompt extends a cache kept under its `prompt_cache_key` (the
               episode's last turn: `kept_caches`) takes that cache and prefills only the rest, in
               a second forward that attends to the cached start
            5. ONE read to the host of every token drawn in 3 and 4, with its logprob and whether
               its row ended (stop token, max_new_tokens); stop strings are checked on the host,
               for the rows that have them
            6. finished rows leave and the last row moves into each hole, so running rows are
               always 0..n-1; those with a `prompt_cache_key` first copy their cache to a kept row
            A decode or prefill that raises is retried one request at a time; a request that still
            fails, or whose logits are NaN/inf, ends with a `FailedUpdate` and the others go on.
                                                       │
                                                       ▼
    list[GenerationUpdate]: the final update of each finished request, plus per-step deltas for
    `stream_tokens` requests; every token carries its logprob and the weight version that made it.

Pinned requests (`GenerationRequest.weight_version`) are admitted only at the version the engine
holds from its next step on, and while one is queued or running no version is swapped in: one
received meanwhile waits, staged as a copy (a newer one replaces it), and becomes the next version
when the last pinned request ends. Admission, the count of pinned requests and the choice of the
next version share one lock, so a pinned request never sees a token of another version.

Host work per decode step does not grow with the batch: what the forward and the draw read (each
row's last token, position, sampling parameters, uniform numbers from its seed, stop ids, limit)
stays on the device in `RunningBatch` (`batch`) between steps, written once at admission and
advanced in place by each draw; sampling is tensor operations over all rows (`sampling`); the host
keeps the generated tokens in arrays filled from the step's one read, and does per-row Python only
for rows that finish, stream, or have stop strings.

The slot KV cache is `pipelinerl.inference.kv_cache`; request checks (`validation`) and stop strings
(`stop`) are shared with the vLLM engine.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason, SamplingParams, TokenSequence
from pipelinerl.inference.batch import LENGTH, STOP_TOKEN, Drawn, RunningBatch
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.flat_weights import FlatParameters, Swap
from pipelinerl.inference.kept_caches import KeptCaches
from pipelinerl.inference.kv_cache import (
    CachePlan,
    SlotKVCache,
    cache_argument,
    capacity_for,
    check_attention_window,
)
from pipelinerl.inference.pinning import PinnedWaits, check_pinned
from pipelinerl.inference.sequence import SequenceState, eos_token_ids
from pipelinerl.inference.stop import completion_text
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate, Limits
from pipelinerl.inference.validation import check_request, check_weights

log = get_logger(__name__)


@dataclass
class FailedUpdate(GenerationUpdate):
    """The final update (finish reason `abort`) of a request the engine could not continue."""

    error: str = ""


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the built-in engine's batch and counters; the runner reports part of it as
    `InferenceStatus`."""

    running: int
    queued: int
    max_running: int
    max_queued: int
    weight_version: int
    generated_tokens: int
    """Since the engine started."""
    tokens_per_s: float
    """Tokens generated over the compute time of the last steps."""
    decode_steps: int
    """Decode forwards since the engine started."""
    decoded_rows: int
    """Running sequences summed over those forwards: over `decode_steps`, the mean batch occupancy."""
    last_swap_s: float
    """How long the last weight swap held up decoding (the copy into the parameters)."""
    pinned_waits: int
    """Received versions that waited, staged, behind pinned requests."""
    pinned_wait_s: float
    """Seconds they waited, the current wait included."""
    prefill_tokens: int = 0
    """Prompt tokens run through the model since the engine started (a group's shared prompt once)."""
    reused_prompt_tokens: int = 0
    """Prompt tokens taken from kept caches instead (`prompt_cache_key`)."""
    kept_caches: int = 0
    """Caches kept now for their key's next request."""


@dataclass(frozen=True)
class _Staged:
    """A received version not yet in the model."""

    version: int
    swaps: tuple[Swap, ...]
    """Copied in this order, so a later one's tensors win: the swaps of older versions not yet
    swapped in that name tensors the newest does not (a version may name only some of them)."""


def _staged(previous: _Staged | None, version: int, swaps: tuple[Swap, ...]) -> _Staged:
    """`version` staged over `previous`, an older one not swapped in yet."""
    if previous is None:
        return _Staged(version, swaps)
    names = set().union(*(swap.names for swap in swaps))
    return _Staged(version, (*(s for s in previous.swaps if not s.names <= names), *swaps))


class InferenceEngine:
    """Continuous batching over `model`. `add_request`, `abort`, `stage_weights` and `stats` may be
    called from any thread; `step` from one thread at a time."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        settings: EngineSettings | None = None,
        *,
        weight_version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.device, self.dtype = model.device, model.dtype
        """Where the model lives and its compute dtype, read once: HF's properties scan the parameters."""
        self.tokenizer = tokenizer
        self.settings = settings or EngineSettings()
        self.max_model_len = self.settings.max_model_len or model.config.max_position_embeddings
        check_attention_window(model, self.max_model_len)
        self.vocab_size = _vocab_size(model)
        """Token ids in [0, vocab_size) are accepted in prompts."""
        self.eos_token_ids = eos_token_ids(model.generation_config, tokenizer)
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self._flat = FlatParameters(self._params)
        self._cache = SlotKVCache(model.config.num_hidden_layers, self.settings.max_running)
        kept = self.settings.max_kept_caches
        self._kept = KeptCaches(
            self.settings.max_running, self.settings.max_running if kept is None else kept
        )
        self._cache_argument = cache_argument(model)
        self._batch = RunningBatch(self.settings.max_running, self.settings.max_new_tokens, self.device)
        self._key_positions = torch.arange(self.max_model_len, device=self.device)
        self._version = weight_version
        self._lock = threading.Lock()
        self._queue: deque[SequenceState] = deque()
        self._running: list[SequenceState] = []
        self._ended: set[int] = set()
        """Rows that finished during this step; they leave the batch at its end."""
        self._live_ids: set[str] = set()
        self._aborts: set[str] = set()
        self._next: _Staged | None = None
        """Swapped in at the start of the next step, whatever is pinned."""
        self._waiting: _Staged | None = None
        """Received while pinned requests run; exists only while `_pinned` > 0."""
        self._pinned = 0
        """Pinned requests queued or running."""
        self._pinned_waits = PinnedWaits()
        self._generated = 0
        self._decode_steps = 0
        self._decoded_rows = 0
        self._recent_steps: deque[tuple[int, float]] = deque(maxlen=64)
        self._last_swap_s = 0.0
        self._prefill_tokens = 0
        self._reused_tokens = 0

    # ---- inputs (any thread) ------------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        """Queue `request`; raises InvalidArgument for a bad request, ResourceExhausted when full,
        VersionNotHeld for a request pinned to another version than the one every token it gets
        would carry (the next version's, if one is staged to be swapped in)."""
        check_request(request, self.limits, self.vocab_size, self.tokenizer)
        sequence = SequenceState.start(request, self._stop_ids(request.sampling), self.tokenizer)
        with self._lock:
            if request.request_id in self._live_ids:
                raise InvalidArgument.field("request_id", f"{request.request_id!r} is already in use")
            if len(self._queue) >= self.settings.max_queued:
                raise ResourceExhausted(f"the queue holds its maximum of {self.settings.max_queued} requests")
            if request.weight_version is not None:
                held = self._version if self._next is None else self._next.version
                check_pinned(request.weight_version, held)
                self._pinned += 1
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
    ) -> bool:
        """Stage weights of `version`; the next `step` copies them into the model before it decodes.

        One call is one atomic update: pass every tensor of the version together (a subset updates
        only those parameters).

        True: the tensors are kept by reference until that swap, so the caller must not modify them
        meanwhile. False: pinned requests are queued or running, so the version waits for the last
        of them to end; it is staged as host-memory copies, and the caller may reuse its tensors at
        once. That costs one more copy of the version's weights in host memory until its swap (two
        while a newer version is being copied to replace it), and the copy's time in this thread.

        The first version of each bucket layout is copied here, in this thread, into the memory the
        parameters will live in from its swap on (`flat_weights`): one more copy of it until then.
        """
        tensors = dict(named_tensors)
        check_weights(tensors, self._params)
        swap = Swap.of(tensors, self._params)
        prepared = self._flat.prepared(swap)  # here, not in the swap: the first touch of new memory
        with self._lock:
            self._check_newer(version)
            if not self._pinned:
                self._next = _staged(self._next, version, (prepared,))
                return True
        # Copied outside the lock: admission and decoding go on meanwhile.
        copy = swap.copied("cpu")
        with self._lock:
            self._check_newer(version)
            pinned = self._pinned
            if pinned:
                self._waiting = _staged(self._waiting, version, (copy,))
                self._pinned_waits.began()
            else:  # the last pinned request ended during the copy
                self._next = _staged(self._next, version, (copy,))
        log.info(
            "weights staged behind pinned requests",
            weight_version=version,
            held_version=self._version,
            pinned=pinned,
            copied_bytes=copy.nbytes,
        )
        return False

    def _check_newer(self, version: int) -> None:
        """Under the lock: refuse a version not newer than every one held or staged."""
        newest = max([self._version, *(s.version for s in (self._next, self._waiting) if s is not None)])
        if version <= newest:
            raise FailedPrecondition(f"weight version {version} is not newer than version {newest}")

    # ---- the loop -----------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._queue or self._aborts or self._next)

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def limits(self) -> Limits:
        settings = self.settings
        return Limits(settings.max_running, settings.max_new_tokens, self.max_model_len, settings.queue_ahead)

    def stats(self) -> SchedulerStats:
        """Safe from any thread."""
        recent = list(self._recent_steps)  # one C-level copy: step() may append meanwhile
        tokens = sum(n for n, _ in recent)
        seconds = sum(s for _, s in recent)
        with self._lock:
            pinned_waits, pinned_wait_s = self._pinned_waits.versions, self._pinned_waits.seconds
        return SchedulerStats(
            running=len(self._running),
            queued=len(self._queue),
            max_running=self.settings.max_running,
            max_queued=self.settings.max_queued,
            weight_version=self._version,
            generated_tokens=self._generated,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            decode_steps=self._decode_steps,
            decoded_rows=self._decoded_rows,
            last_swap_s=self._last_swap_s,
            pinned_waits=pinned_waits,
            pinned_wait_s=pinned_wait_s,
            prefill_tokens=self._prefill_tokens,
            reused_prompt_tokens=self._reused_tokens,
            kept_caches=len(self._kept),
        )

    @torch.no_grad()
    def step(self) -> list[GenerationUpdate]:
        """Swap staged weights, apply aborts, decode the running batch once, prefill newcomers."""
        started = time.perf_counter()
        generated_before = self._generated
        self._swap_staged_weights()
        outputs = self._apply_aborts()
        if self._running:
            self._decode_steps += 1
            self._decoded_rows += len(self._running)
            self._isolated(self._decode, range(len(self._running)))
        newcomers = self._admit()
        if newcomers:
            start = len(self._running)
            self._running.extend(newcomers)
            self._batch.add(start, newcomers)
            whole = start + sum(not s.reused for s in newcomers)  # those first: see _admit
            if whole > start:
                self._isolated(self._prefill, range(start, whole))
            if whole < len(self._running):
                rest = range(whole, len(self._running))
                self._copy_kept(rest)
                self._isolated(self._extend, rest)
        for drawn in self._batch.read(self._version):
            self._take(drawn)
        outputs += self._collect_updates()
        self._recent_steps.append((self._generated - generated_before, time.perf_counter() - started))
        return outputs

    def _swap_staged_weights(self) -> None:
        with self._lock:
            staged, self._next = self._next, None
            if staged is None:
                return
            version = self._version = staged.version
        self._kept.drop_older(version - self.settings.kept_cache_max_lag)
        started = time.perf_counter()
        copies = sum(self._flat.copy_in(swap) for swap in staged.swaps)
        del staged  # the last reference to the received buffers: freeing them is part of the hold-up
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the copies run ahead of the host: time them
        self._last_swap_s = time.perf_counter() - started
        log.info(
            "weights swapped",
            weight_version=version,
            copies=copies,
            seconds=round(self._last_swap_s, 4),
        )

    def _apply_aborts(self) -> list[GenerationUpdate]:
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            if not aborts:
                return []
            queued = [s for s in self._queue if s.request.request_id in aborts]
            self._queue = deque(s for s in self._queue if s.request.request_id not in aborts)
        rows = [row for row, s in enumerate(self._running) if s.request.request_id in aborts]
        outputs = [self._final_update(s, FinishReason.ABORT, None) for s in queued]
        outputs += [self._final_update(self._running[row], FinishReason.ABORT, row) for row in rows]
        self._release(rows)
        return outputs

    def _admit(self) -> list[SequenceState]:
        """Queued requests that fit, in order, those that prefill their whole prompt first, then
        those that take a kept cache (their kept rows taken; `_copy_kept` copies them)."""
        free_rows = self.settings.max_running - len(self._running)
        admitted: list[SequenceState] = []
        longest = 0
        with self._lock:
            while self._queue and len(admitted) < free_rows:
                request = self._queue[0].request
                if request.weight_version not in (None, self._version):
                    break  # pinned to the next version, staged after this step's swap: it waits one step
                lag = self.settings.kept_cache_max_lag if request.weight_version is None else 0
                reused = self._kept.reusable(
                    request.prompt_cache_key, request.prompt_token_ids, self._version - lag
                )
                padded_longest = max(longest, len(request.prompt_token_ids) - reused)
                if admitted and padded_longest * (len(admitted) + 1) > self.settings.max_prefill_tokens:
                    break
                sequence = self._queue.popleft()
                sequence.cache_version = self._version
                if reused:
                    kept = self._kept.take(request.prompt_cache_key)
                    sequence.reused, sequence.reused_row, sequence.cache_version = (
                        reused,
                        kept.row,
                        kept.version,
                    )
                elif request.prompt_cache_key:
                    self._kept.drop(request.prompt_cache_key)  # a prompt that does not extend it
                admitted.append(sequence)
                longest = padded_longest
        return sorted(admitted, key=lambda s: s.reused > 0)

    def _isolated(self, run: Callable[[range], None], rows: range) -> None:
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
                        self._isolated(run, range(row, row + 1))
            else:
                self._fail(rows[0], repr(exc))

    def _fail(self, row: int, error: str) -> None:
        sequence = self._running[row]
        log.error("request failed in the engine", request_id=sequence.request.request_id, error=error)
        self._end(row, FinishReason.ABORT)
        sequence.error = error

    def _end(self, row: int, reason: FinishReason) -> None:
        self._running[row].finish_reason = reason
        self._ended.add(row)

    def _decode(self, rows: range) -> None:
        """One token for each of these running rows, in one forward of q_len 1; every input comes
        from the batch state on the device, the attention length from its host positions."""
        batch, index = self._batch, slice(rows.start, rows.stop)
        positions = batch.positions[index]
        kv_len = int(batch.host_positions[index].max()) + 1
        allowed = (self._key_positions[None, :kv_len] <= positions[:, None])[:, None, None, :]
        plan = CachePlan(
            rows=batch.row_ids[index],
            positions=positions,
            real=None,
            capacity=capacity_for(kv_len, self.max_model_len),
            read=(index, kv_len),
        )
        logits = self._forward(batch.last_ids[index, None], positions[:, None], allowed, plan)
        batch.sample(rows, logits)

    def _prefill(self, rows: range) -> None:
        """Prompts of these running rows (not yet prefilled), left-padded to the longest one, so the
        last column holds every row's next-token logits; the cache stores each prompt from index 0
        (padding is never written). A prompt that several rows share (the attempts of one group) is
        computed once: its cache row is copied to the others, which sample from the same logits."""
        newcomers = self._running[rows.start : rows.stop]
        unique: dict[tuple[int, ...], int] = {}
        owners = [unique.setdefault(tuple(s.request.prompt_token_ids), len(unique)) for s in newcomers]
        computed = [rows[owners.index(i)] for i in range(len(unique))]
        device = self.device
        prompts = [list(prompt) for prompt in unique]
        width = max(len(prompt) for prompt in prompts)
        starts = torch.tensor([width - len(prompt) for prompt in prompts], device=device)
        padded = [[self._pad_id] * (width - len(prompt)) + prompt for prompt in prompts]
        input_ids = torch.tensor(padded, device=device)  # one tensor, not one copy per row
        columns = torch.arange(width, device=device)
        real = columns[None, :] >= starts[:, None]
        positions = (columns[None, :] - starts[:, None]).clamp(min=0)
        causal = columns[None, :] <= columns[:, None]
        allowed = (causal[None, :, :] & real[:, None, :])[:, None]
        lengths = np.array([len(prompt) for prompt in prompts])
        plan = self._write_plan(np.asarray(computed), lengths, np.zeros_like(lengths), width, None)
        self._prefill_tokens += int(lengths.sum())
        logits = self._forward(input_ids, positions, allowed, plan)
        copies = [
            (computed[owner], row) for row, owner in zip(rows, owners, strict=True) if row != computed[owner]
        ]
        if copies:
            self._cache.copy_rows([source for source, _ in copies], [target for _, target in copies], width)
        self._batch.sample(rows, logits[owners] if len(unique) < len(rows) else logits)

    def _copy_kept(self, rows: range) -> None:
        """These newcomers' kept caches copied into their rows, in one copy per buffer."""
        sequences = self._running[rows.start : rows.stop]
        length = max(s.reused for s in sequences)
        self._cache.copy_rows([s.reused_row for s in sequences], list(rows), length)
        self._reused_tokens += sum(s.reused for s in sequences)

    def _extend(self, rows: range) -> None:
        """Prompts of these running rows whose first `reused` tokens are in their cache rows
        already: the rest of each, left-padded to the longest rest, attending to the cached start
        and to itself (causally); the cache stores the rest at its positions."""
        sequences = self._running[rows.start : rows.stop]
        cached = np.array([s.reused for s in sequences])
        rests = [s.request.prompt_token_ids[s.reused :] for s in sequences]
        lengths = np.array([len(rest) for rest in rests])
        width = int(lengths.max())
        pads = width - lengths
        self._prefill_tokens += int(lengths.sum())
        device = self.device
        padded = [[self._pad_id] * pad + rest for pad, rest in zip(pads, rests, strict=True)]
        input_ids = torch.tensor(padded, device=device)
        columns = np.arange(width)
        positions = np.maximum(cached[:, None] + columns[None, :] - pads[:, None], 0)
        kv_len = int((cached + lengths).max())
        real = torch.from_numpy(columns[None, :] >= pads[:, None]).to(device)
        query_positions = torch.from_numpy(positions).to(device)
        allowed = (self._key_positions[None, None, :kv_len] <= query_positions[:, :, None]) & real[:, :, None]
        read = (slice(rows.start, rows.stop), kv_len)
        plan = self._write_plan(np.arange(rows.start, rows.stop), lengths, cached, width, read)
        logits = self._forward(input_ids, query_positions, allowed[:, None], plan)
        self._batch.sample(rows, logits)

    def _write_plan(
        self,
        rows: np.ndarray,
        lengths: np.ndarray,
        first: np.ndarray,
        width: int,
        read: tuple[slice, int] | None,
    ) -> CachePlan:
        """The plan of a forward over left-padded inputs of `width` columns: input i holds
        `lengths[i]` real tokens, for cache row `rows[i]` from position `first[i]` on. Worked out
        from the lengths on the host: a boolean index of the real columns would make the host wait
        for the device."""
        input_of = np.repeat(np.arange(len(lengths)), lengths)
        offset = np.arange(lengths.sum()) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        index = np.stack(
            [rows[input_of], first[input_of] + offset, input_of, offset + (width - lengths)[input_of]]
        )
        index = torch.from_numpy(index).to(self.device)
        end = width if read is None else read[1]
        return CachePlan(
            rows=index[0],
            positions=index[1],
            real=(index[2], index[3]),
            capacity=capacity_for(end, self.max_model_len),
            read=read,
        )

    def _forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, allowed: torch.Tensor, plan: CachePlan
    ) -> torch.Tensor:
        """Next-token logits [batch, vocab] at the last column of `input_ids`."""
        # Additive mask with the dtype's minimum rather than -inf: a padding query that may see no
        # key at all then gets a uniform (ignored) attention instead of NaN.
        blocked = torch.finfo(self.dtype).min
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, blocked)
        self._cache.plan = plan
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=mask,
            use_cache=True,
            **{self._cache_argument: self._cache},
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def _take(self, drawn: Drawn) -> None:
        """The host's part of a draw: rows that ended, failed or watch for stop strings."""
        self._generated += int(drawn.valid.sum())
        index = slice(drawn.rows.start, drawn.rows.stop)
        notable = (drawn.ended != 0) | ~drawn.valid | self._batch.watched[index]
        for offset in np.flatnonzero(notable).tolist():
            row = drawn.rows[offset]
            sequence = self._running[row]
            if not drawn.valid[offset]:
                self._fail(row, "the model's logits are NaN or infinite")
            elif drawn.ended[offset] == STOP_TOKEN or (
                sequence.watcher is not None and sequence.watcher.push(self._batch.token_ids(row))
            ):
                self._end(row, FinishReason.STOP)
            elif drawn.ended[offset] == LENGTH:
                self._end(row, FinishReason.LENGTH)

    def _collect_updates(self) -> list[GenerationUpdate]:
        ended, self._ended = self._ended, set()
        self._keep(ended)
        streaming = np.flatnonzero(self._batch.streams[: len(self._running)]).tolist()
        outputs = []
        for row in sorted(ended.union(streaming)):
            sequence = self._running[row]
            if sequence.finish_reason is not None:
                outputs.append(self._final_update(sequence, sequence.finish_reason, row))
            else:
                outputs.append(self._delta(row))
        self._release(sorted(ended))
        return outputs

    def _keep(self, rows: set[int]) -> None:
        """The caches of these ended rows whose request has a `prompt_cache_key`, copied to kept
        rows: the prompt and completion but the last token (drawn, never fed through the model).
        Not kept: a request aborted or failed, or one whose cache is older than
        `kept_cache_max_lag` allows (with 0: one that ran across a weight swap)."""
        if not self._kept.rows:
            return
        copies: dict[int, int] = {}  # kept row -> running row: a key kept twice keeps its last
        length = 0
        for row in sorted(rows):
            sequence = self._running[row]
            key = sequence.request.prompt_cache_key
            too_old = sequence.cache_version < self._version - self.settings.kept_cache_max_lag
            if not key or sequence.finish_reason is FinishReason.ABORT or too_old:
                continue
            tokens = np.array(sequence.request.prompt_token_ids + self._batch.token_ids(row)[:-1])
            copies[self._kept.keep(key, tokens, sequence.cache_version)] = row
            length = max(length, len(tokens))
        if copies:
            self._cache.add_rows(self._kept.first_row + self._kept.rows)
            self._cache.copy_rows(list(copies.values()), list(copies), length)

    def _delta(self, row: int) -> GenerationUpdate:
        """The row's tokens not yet handed out, as a non-final update."""
        sequence = self._running[row]
        tokens = self._batch.tokens(row, sequence.emitted)
        sequence.emitted += len(tokens)
        return GenerationUpdate(sequence.request.request_id, tokens)

    def _release(self, rows: list[int]) -> None:
        """Remove rows from the batch; rows past the new end move into the holes below it (one
        batched cache copy), so running rows stay 0..n-1."""
        if not rows:
            return
        removed = set(rows)
        end = len(self._running) - len(removed)
        holes = [row for row in sorted(removed) if row < end]
        movers = [row for row in range(end, len(self._running)) if row not in removed]
        if movers:
            length = int(self._batch.host_positions[movers].max())
            self._cache.copy_rows(movers, holes, length)
            self._batch.move(movers, holes)
            for hole, mover in zip(holes, movers, strict=True):
                self._running[hole] = self._running[mover]
        del self._running[end:]

    def _final_update(
        self, sequence: SequenceState, reason: FinishReason, row: int | None
    ) -> GenerationUpdate:
        """`row`: the sequence's row, None for one that never ran."""
        request = sequence.request
        with self._lock:
            self._live_ids.discard(request.request_id)
            if request.weight_version is not None:
                self._unpin()
        update = (
            self._delta(row) if row is not None else GenerationUpdate(request.request_id, TokenSequence())
        )
        if sequence.error is not None:
            update = FailedUpdate(update.request_id, update.tokens, error=sequence.error)
        update.finish_reason = reason
        token_ids = self._batch.token_ids(row) if row is not None else []
        update.text = completion_text(self.tokenizer, token_ids, request.sampling.stop)
        log.debug("request finished", request_id=request.request_id, finish_reason=reason.value)
        return update

    def _unpin(self) -> None:
        """Under the lock: a pinned request has ended; after the last one, the waiting version is next."""
        self._pinned -= 1
        if self._pinned or self._waiting is None:
            return
        self._pinned_waits.ended()
        self._next = _staged(self._next, self._waiting.version, self._waiting.swaps)
        self._waiting = None
        log.info("pinned requests done; swapping in the waiting version", weight_version=self._next.version)

    @property
    def _pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if isinstance(pad, int) else 0

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        eos = frozenset() if self.settings.ignore_eos else self.eos_token_ids
        return frozenset(params.stop_token_ids) | eos


def _vocab_size(model: PreTrainedModel) -> int:
    """Rows of the output layer: every token id the model can produce."""
    weight = getattr(model.get_output_embeddings(), "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError("the built-in engine needs a causal LM with an output layer")
    return weight.shape[0]
