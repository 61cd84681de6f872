"""KV caches the built-in engine keeps between the turns of an episode (`prompt_cache_key`).

A request that finishes with a key leaves its cache in a row of the slot cache past the running
rows, with the tokens that row holds: its prompt and completion but the last token, which was
drawn and never fed through the model. The next request with that key whose prompt starts with
those tokens takes the row's cache and prefills only the rest of its prompt: the environment's
reply and the next turn's opener, instead of the whole history again.

    finished with a key ──► keep(key, tokens, version) ──► a free row, else the key's own, else
                                                           the least recently kept one's
    admitted with a key ──► reusable(key, prompt, oldest) ─► how much of the prompt it holds: all its
                            take(key)                        tokens when the prompt starts with them
                                                             and goes beyond, and it is not older
    weights swapped ──────► drop_older(oldest)             rows of caches now too old are freed

A cache's `version` is the oldest weight version among its keys and values. The engine's
`kept_cache_max_lag` (0 by default) is how far behind the weights it holds that may be: at 0 a
cache is kept only if no swap came while its request ran and a swap drops them all, so a prompt
gets the keys and values a fresh prefill would compute, up to float rounding, as the vLLM engine's
prefix cache salted with the version does; above 0 the next turn continues on older keys and
values, as a sequence that runs across an update does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Kept:
    """A kept cache: its row in the slot cache and the tokens its first positions hold."""

    row: int
    tokens: np.ndarray
    version: int
    """The oldest weight version among its keys and values."""


class KeptCaches:
    """Up to `rows` kept caches in the slot cache's rows first_row, first_row + 1, ...; touched by
    the engine's step thread only."""

    def __init__(self, first_row: int, rows: int) -> None:
        self.first_row, self.rows = first_row, rows
        self._free = list(range(first_row + rows - 1, first_row - 1, -1))
        self._kept: OrderedDict[str, Kept] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, key: str, tokens: np.ndarray, version: int) -> int:
        """The row to copy the cache of `tokens` into, now kept under `key` (`rows` must be 1 or more)."""
        if key in self._kept:
            row = self._kept.pop(key).row
        elif self._free:
            row = self._free.pop()
        else:
            row = self._kept.popitem(last=False)[1].row
        self._kept[key] = Kept(row, tokens, version)
        return row

    def reusable(self, key: str, prompt: list[int], oldest: int) -> int:
        """How many leading tokens of `prompt` the cache kept under `key` holds: all its tokens
        when the prompt starts with them and has more and the cache is of version `oldest` or
        newer, else 0."""
        kept = self._kept.get(key) if key else None
        if kept is None or len(kept.tokens) >= len(prompt) or kept.version < oldest:
            return 0
        return len(kept.tokens) if np.array_equal(kept.tokens, prompt[: len(kept.tokens)]) else 0

    def take(self, key: str) -> Kept:
        """The cache kept under `key`, no longer kept: its row is free again once the caller has
        copied it, which must happen before the next `keep`."""
        kept = self._kept.pop(key)
        self._free.append(kept.row)
        return kept

    def drop(self, key: str) -> None:
        """Forget the cache kept under `key`, if any (its next prompt did not extend it)."""
        if (kept := self._kept.pop(key, None)) is not None:
            self._free.append(kept.row)

    def drop_older(self, oldest: int) -> None:
        """Forget every cache of a version older than `oldest`."""
        for key in [key for key, kept in self._kept.items() if kept.version < oldest]:
            self.drop(key)
