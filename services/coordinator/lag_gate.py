"""Which weight versions may take prompts: those whose samples the trainer's lag policy will still
admit, judged from what the coordinator hears of the trainer.

    GetStatus (polled) ──────────► version, max_lag ──────────────────┐
    SubmitSamples responses ─────► version (acks), resumed, retraining ┴─► admits(server version)

A server takes prompts only while

- its version is within `max_lag` of the trainer's newest version, learnt from the acks as they
  arrive (a poll alone would lag a trainer that steps several times a second);
- its version is not older than the trainer's when the current SubmitSamples stream first answered
  (`resumed`): after a trainer restart, the weights a server still holds may be ones the crash lost,
  and the restarted trainer soon steps past them (below);
- the trainer is not retraining samples resent on that stream: a restarted trainer retrains the
  steps its crash lost back to back, with no fresh sample needed, so anything generated meanwhile
  would be as many versions old when it arrived, and a replay longer than `max_lag` would have it
  dropped.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamState:
    """What the coordinator's SubmitSamples stream has told of the trainer."""

    version: int
    """The newest version the trainer acked with."""
    resumed: int
    """`version` once the current stream first answered with acks; -1 before."""
    retraining: bool
    """Samples resent on the current stream (trained before it broke) are not answered yet."""


class LagGate:
    def __init__(self, known: bool = False) -> None:
        """`known`: admit before the trainer has told anything (a pool without a trainer)."""
        self.known = known
        """Whether GetStatus has told the trainer's version and max_lag once; until then nothing
        is admitted."""
        self._status_version = 0
        self._max_lag = 0
        self._stream = StreamState(-1, -1, retraining=False)

    @property
    def trainer_version(self) -> int:
        return max(self._status_version, self._stream.version)

    @property
    def floor(self) -> int:
        """The oldest version admitted (once known and not retraining)."""
        return max(self.trainer_version - self._max_lag, self._stream.resumed)

    @property
    def retraining(self) -> bool:
        return self._stream.retraining

    def admits(self, version: int) -> bool:
        return self.known and not self.retraining and version >= self.floor

    def status(self, version: int, max_lag: int) -> None:
        """What the trainer's GetStatus said."""
        self._status_version, self._max_lag, self.known = version, max_lag, True

    def stream(self, state: StreamState) -> None:
        """What the trainer's stream said last."""
        self._stream = state
