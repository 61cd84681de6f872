"""A request's decoding state inside the built-in engine: its tokens, its random generator, and
when it finishes (a stop token, a stop string, or `max_new_tokens`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.inference.sampling import make_generator
from pipelinerl.inference.stop import StopStringWatcher
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate, tokens_from


@dataclass(eq=False)
class SequenceState:
    """A request's decoding state. Its cache row is its index in the engine's running list."""

    request: GenerationRequest
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    """A seeded request's own; None: the engine's shared generator draws its tokens."""
    watcher: StopStringWatcher | None
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
    ) -> SequenceState:
        params = request.sampling
        watcher = StopStringWatcher(tokenizer, params.stop) if params.stop else None
        # On the logits' device, which torch.multinomial requires of its generator.
        generator = None if params.seed is None else make_generator(params.seed, device)
        return cls(request, stop_ids, generator, watcher)

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
        return GenerationUpdate(self.request.request_id, tokens_from(self.tokens, start))


def eos_token_ids(generation: GenerationConfig | None, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """EOS ids from the model's generation config (may be a list) and the tokenizer."""
    configured = getattr(generation, "eos_token_id", None)
    ids: set[int] = {configured} if isinstance(configured, int) else set(configured or ())
    if isinstance(tokenizer.eos_token_id, int):
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
