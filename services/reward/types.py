"""Domain types of the reward service: what is scored, what comes back, and the scorer's interface.

Plain picklable dataclasses: the scorer sends items to its worker processes and results back
through pipes. `convert.py` converts them to and from `pipelinerl.reward.v1` messages, for the
servicer and the client alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pipelinerl.common.errors import ErrorInfo, InvalidArgument, PipelineError


@dataclass(frozen=True)
class ScoreItem:
    """One completion to score against its gold answer."""

    sample_id: str
    prompt: str
    completion: str
    answer: str
    verifier: str
    """Name of the correctness verifier, for example `math` or `exact`."""


@dataclass(frozen=True)
class VerifierDetail:
    """What one verifier said about one item; the reward is the sum of `weight * score`."""

    verifier: str
    score: float
    weight: float
    message: str


@dataclass(frozen=True)
class ScoreResult:
    """The reward of one item, or the reason it has none."""

    sample_id: str
    reward: float | None
    details: list[VerifierDetail] = field(default_factory=list)
    error: ErrorInfo | None = None

    @property
    def timed_out(self) -> bool:
        """True when the verifier ran past the per-sample timeout."""
        return self.error is not None and self.error.code == "DEADLINE_EXCEEDED"

    @classmethod
    def failed(cls, sample_id: str, exc: PipelineError) -> ScoreResult:
        return cls(sample_id, reward=None, error=ErrorInfo.from_exception(exc))


@dataclass(frozen=True)
class VerifierInfo:
    """A verifier a client may name in `ScoreItem.verifier`."""

    name: str
    description: str


@dataclass(frozen=True)
class ScorerStats:
    """Items by outcome, and worker processes replaced, since the scorer started."""

    scored: int
    invalid: int
    timed_out: int
    failed: int
    worker_restarts: int
    workers: int


MAX_BATCH_ITEMS = 4096


def check_batch(items: list[ScoreItem]) -> None:
    """Raise InvalidArgument if the batch itself is malformed (empty, too large, repeated ids)."""
    if not items:
        raise InvalidArgument.field("items", "is empty")
    if len(items) > MAX_BATCH_ITEMS:
        raise InvalidArgument.field("items", f"has {len(items)} items; at most {MAX_BATCH_ITEMS} per call")
    first_index: dict[str, int] = {}
    for index, item in enumerate(items):
        if item.sample_id and first_index.setdefault(item.sample_id, index) != index:
            raise InvalidArgument.field(
                f"items[{index}].sample_id",
                f"{item.sample_id!r} repeats items[{first_index[item.sample_id]}].sample_id",
            )


class RewardCore(Protocol):
    """The scorer as the servicer sees it."""

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """One result per item, in order; per-item problems are in `ScoreResult.error`."""
        ...

    def list_verifiers(self) -> list[VerifierInfo]: ...

    @property
    def stats(self) -> ScorerStats: ...
