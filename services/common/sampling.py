"""The check of sampling parameters that needs nothing but the parameters, written once.

`pipelinerl.common.convert` runs it on every SamplingParams message, so a bad one is refused by
whichever service receives it first; every engine runs it again (`pipelinerl.inference.validation`)
before its own checks. Raises InvalidArgument naming the field as the caller sent it.
"""

from __future__ import annotations

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import SamplingParams

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
