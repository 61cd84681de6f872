"""Stop strings, handled alike by every engine.

The completion is detokenized incrementally; when a stop string appears the request finishes with
reason `stop`. Its tokens are NOT trimmed (the trainer needs every sampled token and its logprob);
only the final update's `text` is cut before the earliest stop string. Stop tokens (EOS,
`stop_token_ids`) are kept in the tokens too; `text` is decoded without special tokens, so EOS does
not show in it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def completion_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], stops: tuple[str, ...]) -> str:
    """The final update's `text`: the completion decoded, cut before the earliest stop string."""
    text = detokenize(tokenizer, token_ids)
    cuts = [i for i in (text.find(stop) for stop in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def detokenize(tokenizer: PreTrainedTokenizerBase, token_ids: list[int]) -> str:
    # One flat list of ids decodes to one string; the stubs' `list[str]` is for a batch of lists.
    return cast(str, tokenizer.decode(token_ids, skip_special_tokens=True))


class StopStringWatcher:
    """Detokenizes a completion incrementally and reports when a stop string appears in it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self._tokenizer = tokenizer
        self._stops = stops
        self._keep = max(len(stop) for stop in stops) - 1
        self._tail = ""
        # Decoding tokens[prefix:read] again as context keeps tokenizers that merge across token
        # boundaries (leading spaces, multi-byte characters) from producing different text.
        self._prefix = 0
        self._read = 0

    def push(self, token_ids: list[int]) -> bool:
        """True once a stop string appears; `token_ids` is the whole completion so far."""
        context = detokenize(self._tokenizer, token_ids[self._prefix : self._read])
        text = detokenize(self._tokenizer, token_ids[self._prefix :])
        # A token that ends inside a multi-byte character decodes to U+FFFD: wait for the rest.
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return False
        window = self._tail + text[len(context) :]
        self._prefix, self._read = self._read, len(token_ids)
        self._tail = window[max(0, len(window) - self._keep) :]
        return any(stop in window for stop in self._stops)
