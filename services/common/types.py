"""Domain types shared by several services, free of protobuf; `pipelinerl.common.convert` maps
them to and from the `pipelinerl.common.v1` messages."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    STOP = "stop"
    """End-of-sequence token, stop token or stop string."""
    LENGTH = "length"
    """max_new_tokens or the context length was reached."""
    ABORT = "abort"
    """Cancelled, or the server went away."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion (see `pipelinerl.common.v1.SamplingParams` for the limits)."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no limit."""
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass
class TokenSequence:
    """Generated tokens, each with its behaviour logprob and the weight version that produced it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    def extend(self, other: TokenSequence) -> None:
        self.token_ids += other.token_ids
        self.logprobs += other.logprobs
        self.versions += other.versions


class SegmentKind(enum.Enum):
    MODEL = "model"
    """Sampled by the policy: a logprob and a version per token, trained by the loss."""
    CONTEXT = "context"
    """Not sampled by the policy (an environment's reply, template scaffolding): attended to, no loss."""


@dataclass(frozen=True)
class Segment:
    """A run of consecutive completion tokens of one kind (see `Sample.segments`)."""

    kind: SegmentKind
    num_tokens: int


@dataclass
class Sample:
    """A scored completion, as the trainer receives it: one token stream, the prompt (context)
    followed by the completion, whose tokens are all the model's unless `segments` say otherwise."""

    sample_id: str
    group_id: str
    prompt_token_ids: list[int]
    completion: TokenSequence
    reward: float
    finish_reason: FinishReason = FinishReason.STOP
    group_size: int = 1
    segments: tuple[Segment, ...] = ()
    """Empty for a single-turn sample. Otherwise the runs of model and context tokens that tile
    `completion.token_ids` in order, and `completion.logprobs` / `completion.versions` hold one value
    per model token only (the rules are in `pipelinerl.common.v1.Sample.segments`)."""

    @property
    def model_tokens(self) -> int:
        """Completion tokens the model sampled: the ones the loss trains."""
        if not self.segments:
            return len(self.completion.token_ids)
        return sum(s.num_tokens for s in self.segments if s.kind is SegmentKind.MODEL)

    def model_mask(self) -> list[bool]:
        """One flag per completion token: True where the model sampled it."""
        if not self.segments:
            return [True] * len(self.completion.token_ids)
        return [s.kind is SegmentKind.MODEL for s in self.segments for _ in range(s.num_tokens)]


@dataclass(frozen=True)
class WeightVersion:
    """Identity of one set of weights: the trainer's optimizer step count within one trainer run."""

    version: int
    run_id: str = ""
