"""What a client needs to know of the served model: its token range, special ids and tokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from transformers import PreTrainedTokenizerBase

from pipelinerl.inference.types import ModelInfo


def describe_model(
    model: str, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_token_ids: Iterable[int]
) -> ModelInfo:
    """`model` as the server names it; `vocab_size` the token ids its engine accepts."""
    return ModelInfo(
        model=model,
        vocab_size=vocab_size,
        eos_token_ids=tuple(sorted(eos_token_ids)),
        pad_token_id=_token_id(tokenizer.pad_token_id),
        bos_token_id=_token_id(tokenizer.bos_token_id),
        tokenizer=tokenizer.name_or_path or model,
        tokenizer_sha256=tokenizer_sha256(tokenizer),
    )


def tokenizer_sha256(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of everything that decides how text becomes ids: equal digests tokenize alike.

    A fast tokenizer serializes itself whole (normalizer, pre-tokenizer, model, added tokens); a
    slow one is digested from its vocabulary and special tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        serialized = backend.to_str()
    else:
        serialized = json.dumps(
            [sorted(tokenizer.get_vocab().items()), tokenizer.special_tokens_map], sort_keys=True, default=str
        )
    return hashlib.sha256(serialized.encode()).hexdigest()


def _token_id(value: object) -> int | None:
    return value if isinstance(value, int) else None
