"""Lag along the weights' lineage: a restart that resumes from a checkpoint older than the last
version it published loses the versions between, and the versions after it continue from the
checkpoint's weights, so a version's number is no longer its count of optimizer steps.

    published 5 6 7 (lost), crashed; checkpoint at 4; resumed as 8 (the weights of 4)
    lost = [(5, 8)]: lineage_lag(4, 8) = 0, lineage_lag(6, 9) = 1, lineage_lag(3, 9) = 2

The trainer keeps `lost` in its checkpoints (`checkpoint.Resumed.lost`) and judges every lag by
it: a sample's at admission (the lag policy), and each token's in the learner (its lag histogram and
`learner.loss.max_token_lag`).
"""

from __future__ import annotations

from collections.abc import Sequence

Lost = Sequence[tuple[int, int]]
"""(first lost version, the version that resumed) per restart, oldest first."""


def lineage_lag(token_version: int, version: int, lost: Lost) -> int:
    """Optimizer steps from the weights of `token_version` to those of `version`, given the
    versions each restart lost: those are no steps, and a token of a lost version counts as one of
    the version that resumed."""
    lag = version - token_version
    for first, resumed in lost:
        if resumed <= version and token_version < first:
            lag -= resumed - first + 1
        elif first <= token_version < resumed:
            lag = version - resumed
    return max(lag, 0)
