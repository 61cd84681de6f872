"""Requests pinned to one weight version (`GenerationRequest.weight_version`), shared by both engines.

An evaluation must be attributed to exactly one version, so a pinned request is admitted only at
the version the engine holds, and the engine swaps in no other version while one is queued or
running: versions received meanwhile wait, staged. This module holds what both engines need for
that: the refusal, carrying the held version so that a caller can ask again at that one, and the
account of how many versions waited and for how long (`pipelinerl_inference_weight_pinned_*`).
"""

from __future__ import annotations

import time

from pipelinerl.common.errors import FailedPrecondition


class VersionNotHeld(FailedPrecondition):
    """A pinned request asked for a weight version the engine does not hold. On the wire:
    FAILED_PRECONDITION with a `google.rpc.ErrorInfo` whose metadata `weight_version` is
    `held_version` (`pipelinerl.inference.convert`)."""

    def __init__(self, message: str, held_version: int) -> None:
        super().__init__(message)
        self.held_version = held_version


def check_pinned(requested: int | None, held: int) -> None:
    """Refuse a request pinned to `requested` while the engine holds `held`; unpinned ones pass."""
    if requested is not None and requested != held:
        raise VersionNotHeld(
            f"weight_version {requested} is not held: this server holds version {held}", held
        )


class PinnedWaits:
    """Versions that waited, staged, behind pinned requests, and the seconds they waited.

    One version waits at a time: a newer one replaces it (and its wait goes on under the newer
    one's name), so the seconds are the time during which some received version waited."""

    def __init__(self) -> None:
        self.versions = 0
        self._seconds = 0.0
        self._since: float | None = None

    def began(self) -> None:
        """A received version is staged behind pinned requests."""
        self.versions += 1
        if self._since is None:
            self._since = time.monotonic()

    def ended(self) -> None:
        """The last pinned request has finished: the waiting version is swapped in next."""
        if self._since is not None:
            self._seconds += time.monotonic() - self._since
            self._since = None

    @property
    def seconds(self) -> float:
        """The current wait included, so that a long evaluation shows as it goes."""
        since = self._since
        return self._seconds + (time.monotonic() - since if since is not None else 0.0)
