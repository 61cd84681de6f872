"""Domain types of the reward service: what is scored, and what comes back.

They are plain dataclasses so the scorer can pickle them to its worker processes; `server.py`
converts them to and from `pipelinerl.reward.v1` messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pipelinerl.common.errors import ErrorInfo, PipelineError


@dataclass(frozen=True)
class ScoreItem:
    """One completion to score against its gold answer."""

    sample_id: str
    prompt: str
    completion: str
    answer: str
    verifier: str
    """Name of the correctness verifier, for example `math` or `exact`."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Carried with the item for the caller's bookkeeping; verifiers do not read it."""


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


class RewardCore(Protocol):
    """The scorer as the servicer sees it."""

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        """One result per item, in order; per-item problems are in `ScoreResult.error`."""
        ...

    def list_verifiers(self) -> list[VerifierInfo]: ...
