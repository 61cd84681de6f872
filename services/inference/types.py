"""What the inference servicer needs from an engine, free of protobuf and grpc.

Both engines (built-in and vLLM) are wrapped to this shape: `generate` is an async iterator of
updates for one request; closing it early (client cancel, stream closed) aborts the request and
frees its cache.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from pipelinerl.common.types import FinishReason, SamplingParams, TokenSequence, WeightVersion


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    """Empty when a client sends `prompt_text`; the server tokenizes it before the engine sees it."""
    sampling: SamplingParams
    stream_tokens: bool = False
    prompt_text: str = ""
    weight_version: int | None = None
    """Generate every token with exactly this weight version (`pipelinerl.inference.pinning`):
    admitted only while the engine holds it, which then swaps in no other until the request ends.
    None: any version."""
    prompt_cache_key: str = ""
    """Keep the request's KV cache when it finishes, for the next request with this key whose
    prompt extends this one's prompt and completion (`Submission.prompt_cache_key`); "": none."""


@dataclass
class GenerationUpdate:
    """New tokens of one request; the last update of a request has `finish_reason` set."""

    request_id: str
    tokens: TokenSequence = field(default_factory=TokenSequence)
    finish_reason: FinishReason | None = None
    text: str = ""
    """The whole decoded completion, in the final update only."""


@dataclass
class Completion:
    """A finished request."""

    request_id: str
    prompt_token_ids: list[int]
    tokens: TokenSequence
    text: str
    finish_reason: FinishReason


@dataclass(frozen=True)
class Limits:
    max_running: int
    """Sequences the engine runs at once."""
    max_new_tokens: int
    max_context: int
    queue_ahead: int = 0
    """Requests a client may have waiting for a row on top of `max_running`."""

    @property
    def window(self) -> int:
        """Requests in flight a Generate stream accepts (the flow-control window it advertises)."""
        return self.max_running + self.queue_ahead


@dataclass(frozen=True)
class ModelInfo:
    """The served model as a client sees it (`inference.v1.ModelInfo`)."""

    model: str
    vocab_size: int
    """Token ids in [0, vocab_size) are accepted in prompts."""
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    tokenizer: str
    tokenizer_sha256: str


@dataclass(frozen=True)
class InferenceStatus:
    """What an inference server reports in `GetStatus`, whichever engine serves it."""

    weight_version: WeightVersion
    running: int
    queued: int
    tokens_per_s: float
    weight_updates: int
    failed_weight_updates: int
    engine: str
    model_info: ModelInfo
    decode_steps: int | None = None
    """Decode forwards since the engine started; None where the engine does not count them (vLLM)."""
    decoded_rows: int | None = None
    """Running sequences summed over those forwards (per step: the batch occupancy)."""
    pinned_waits: int | None = None
    """Received versions that waited, staged, behind pinned requests; None where not known (a
    status read over gRPC, which does not carry it)."""
    pinned_wait_s: float | None = None
    """Seconds they waited, the current wait included."""
    prefill_tokens: int | None = None
    """Prompt tokens run through the model since the engine started; None where not counted (vLLM)."""
    reused_prompt_tokens: int | None = None
    """Prompt tokens taken from caches kept between turns (`prompt_cache_key`) instead."""
    kept_caches: int | None = None
    """Caches kept now for their key's next request."""


class InferenceBackend(Protocol):
    """An engine as the servicer sees it."""

    @property
    def limits(self) -> Limits: ...

    @property
    def model_info(self) -> ModelInfo: ...

    def tokenize(self, text: str) -> list[int]: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        """Updates until the final one. Raises InvalidArgument (before any update) for a bad request."""
        ...

    def status(self) -> InferenceStatus: ...


def tokens_from(tokens: TokenSequence, start: int) -> TokenSequence:
    """The tokens from index `start` on: what a delta update carries."""
    return TokenSequence(tokens.token_ids[start:], tokens.logprobs[start:], tokens.versions[start:])
