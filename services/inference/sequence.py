"""A request's host-side record inside the built-in engine: its seed, its stop-string watcher,
what it has handed out, and why it finished. Its tokens and the state a decode step reads live in
the engine's `RunningBatch`, at its row."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import GenerationConfig, PreTrainedTokenizerBase

from pipelinerl.common.types import FinishReason
from pipelinerl.inference.sampling import random_seed
from pipelinerl.inference.stop import StopStringWatcher
from pipelinerl.inference.types import GenerationRequest


@dataclass(eq=False)
class SequenceState:
    """A request's record. Its row is its index in the engine's running list."""

    request: GenerationRequest
    stop_ids: frozenset[int]
    seed: int
    """The request's own seed, or a random one: every row draws from a seed (see `sampling`)."""
    watcher: StopStringWatcher | None
    emitted: int = 0
    """Tokens already handed out in updates."""
    finish_reason: FinishReason | None = None
    error: str | None = None
    """Why the engine could not continue it (it then finishes with `abort`)."""
    reused: int = 0
    """Prompt tokens whose cache it takes from a kept one (`kept_caches`) instead of prefilling."""
    reused_row: int = -1
    """The slot-cache row of that kept cache, copied into its own row before its prefill."""
    cache_version: int = -1
    """The oldest weight version among its cache's keys and values: the version it was admitted
    under, or that of the kept cache it took."""

    @classmethod
    def start(
        cls, request: GenerationRequest, stop_ids: frozenset[int], tokenizer: PreTrainedTokenizerBase
    ) -> SequenceState:
        params = request.sampling
        watcher = StopStringWatcher(tokenizer, params.stop) if params.stop else None
        seed = random_seed() if params.seed is None else params.seed
        return cls(request, stop_ids, seed, watcher)


def eos_token_ids(generation: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from the model's generation config (may be a list) and the tokenizer."""
    configured = getattr(generation, "eos_token_id", None)
    ids: set[int] = {configured} if isinstance(configured, int) else set(configured or ())
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
