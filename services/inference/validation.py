"""Checks of an engine's inputs, written once for every engine.

`check_request` runs `pipelinerl.common.sampling.check_sampling` (the check the wire runs too),
then adds what only the serving engine knows: its limits, vocabulary and tokenizer;
`check_weights` compares staged weights with the model's parameters. All raise InvalidArgument
naming the field as the caller sent it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.sampling import check_sampling
from pipelinerl.inference.types import GenerationRequest, Limits

MAX_CACHE_KEY_BYTES = 128

if TYPE_CHECKING:  # annotations only: the checks need neither at run time
    import torch
    from transformers import PreTrainedTokenizerBase


def check_request(
    request: GenerationRequest, limits: Limits, vocab_size: int, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Refuse a request this engine cannot serve: `check_sampling`, then its context, vocabulary
    and tokenizer. Whether the request id is already in use is the engine's own check."""
    if not request.request_id:
        raise InvalidArgument.field("request_id", "must not be empty")
    if request.weight_version is not None and request.weight_version < 0:
        raise InvalidArgument.field("weight_version", f"{request.weight_version} is negative")
    if len(request.prompt_cache_key.encode()) > MAX_CACHE_KEY_BYTES:
        raise InvalidArgument.field("prompt_cache_key", f"at most {MAX_CACHE_KEY_BYTES} bytes")
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidArgument.field("prompt_token_ids", "must not be empty")
    _check_vocabulary("prompt_token_ids", prompt, vocab_size)
    if len(prompt) >= limits.max_context:
        raise InvalidArgument.field(
            "prompt_token_ids",
            f"{len(prompt)} tokens leave no room in the context of {limits.max_context} tokens",
        )
    params = request.sampling
    check_sampling(params)
    if params.max_new_tokens > limits.max_new_tokens:
        raise InvalidArgument.field(
            "sampling.max_new_tokens", f"exceeds this server's limit of {limits.max_new_tokens}"
        )
    if len(prompt) + params.max_new_tokens > limits.max_context:
        raise InvalidArgument.field(
            "sampling.max_new_tokens",
            f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds the context of "
            f"{limits.max_context} tokens",
        )
    _check_vocabulary("sampling.stop_token_ids", params.stop_token_ids, vocab_size)
    unknown = tokenizer.unk_token_id
    for i, stop in enumerate(params.stop):
        ids = tokenizer.encode(stop, add_special_tokens=False)
        if not ids or (unknown is not None and unknown in ids):
            raise InvalidArgument.field(
                f"sampling.stop[{i}]", f"{stop!r} cannot be tokenized, so it can never be generated"
            )


def check_weights(tensors: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor]) -> None:
    """Refuse weights that are not parameters of the model (`params`), by name and shape."""
    for name, tensor in tensors.items():
        if name not in params:
            raise InvalidArgument.field(f"named_tensors[{name}]", "the model has no such parameter")
        expected = tuple(params[name].shape)
        if tuple(tensor.shape) != expected:
            raise InvalidArgument.field(
                f"named_tensors[{name}]", f"shape {tuple(tensor.shape)} != the model's {expected}"
            )


def _check_vocabulary(field: str, token_ids: Iterable[int], vocab_size: int) -> None:
    for i, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidArgument.field(
                f"{field}[{i}]", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
