"""Checks of an engine's inputs, written once for the wire and for every engine.

`check_sampling` needs only the parameters: `pipelinerl.common.convert` runs it on every
SamplingParams message, so a bad one is refused by whichever service receives it first.
`check_request` adds what only the serving engine knows: its limits, vocabulary and tokenizer;
`check_weights` compares staged weights with the model's parameters. All raise InvalidArgument
naming the field as the caller sent it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import SamplingParams
from pipelinerl.inference.types import GenerationRequest, Limits

if TYPE_CHECKING:  # torch is heavy, and this module is imported by torch-free services
    import torch
    from transformers import PreTrainedTokenizerBase

MAX_TEMPERATURE = 100.0
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256


def check_sampling(params: SamplingParams, field: str = "sampling") -> None:
    """Refuse sampling parameters that no server accepts, whatever its model."""
    if params.max_new_tokens < 1:
        raise InvalidArgument.field(f"{field}.max_new_tokens", "must be >= 1")
    if not 0 <= params.temperature <= MAX_TEMPERATURE:  # also rejects NaN
        raise InvalidArgument.field(
            f"{field}.temperature", f"must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy)"
        )
    if not 0 < params.top_p <= 1:
        raise InvalidArgument.field(f"{field}.top_p", "must be in (0, 1]")
    if params.top_k < 0:
        raise InvalidArgument.field(f"{field}.top_k", "must be >= 0 (0 disables it)")
    for i, token in enumerate(params.stop_token_ids):
        if token < 0:
            raise InvalidArgument.field(f"{field}.stop_token_ids[{i}]", "token ids must be >= 0")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument.field(f"{field}.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for i, stop in enumerate(params.stop):
        if not 0 < len(stop.encode()) <= MAX_STOP_STRING_BYTES:
            raise InvalidArgument.field(f"{field}.stop[{i}]", f"must be 1 to {MAX_STOP_STRING_BYTES} bytes")


def check_request(
    request: GenerationRequest, limits: Limits, vocab_size: int, tokenizer: PreTrainedTokenizerBase
) -> None:
    """Refuse a request this engine cannot serve: `check_sampling`, then its context, vocabulary
    and tokenizer. Whether the request id is already in use is the engine's own check."""
    if not request.request_id:
        raise InvalidArgument.field("request_id", "must not be empty")
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
