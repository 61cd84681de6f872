"""What a decode step asks of the device: one read to the host per step, whatever the batch holds,
and no operation that would make the host wait for the device (on a GPU, each of those is a
synchronisation that leaves the accelerator idle while the host catches up)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pipelinerl.common.model import LoadedModel, build_preset
from pipelinerl.common.types import SamplingParams
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.types import GenerationRequest

aten = torch.ops.aten
WAITS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}
"""Operations whose result the host needs at once: `int(t)`, `bool(t)`, data-dependent shapes."""
INDEXING = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default}
"""A boolean index is a `nonzero` inside."""


class DeviceWaits(TorchDispatchMode):
    """Records every operation that makes the host wait for the device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        boolean_index = func in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
        )
        if func in WAITS or boolean_index:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return build_preset("tiny", seed=0)


def test_every_step_reads_the_device_once_and_never_waits_on_it_otherwise(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy, seeded, unseeded, top-k/top-p, stop-token and stop-string requests, more than the
    rows, so that steps decode, finish, admit and prefill together."""
    reads: list[str] = []

    def counted(name: str) -> Callable[..., Any]:
        real = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            reads.append(name)
            return real(self, *args, **kwargs)

        return read

    for name in ("numpy", "tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    engine = InferenceEngine(tiny.model, tiny.tokenizer, EngineSettings(max_running=4, ignore_eos=True))
    prompt = tiny.tokenizer("12+34=")["input_ids"]
    kinds = [
        SamplingParams(temperature=0, max_new_tokens=9),
        SamplingParams(seed=3, top_p=0.9, max_new_tokens=14),
        SamplingParams(top_k=5, max_new_tokens=6),
        SamplingParams(stop_token_ids=(7, 8), max_new_tokens=11),
        SamplingParams(stop=("never seen",), max_new_tokens=12),
        SamplingParams(temperature=0.5, max_new_tokens=5),
    ]
    for i, sampling in enumerate(kinds):
        engine.add_request(GenerationRequest(f"r{i}", [*prompt, i + 4], sampling))
    per_step: list[tuple[int, int]] = []  # (reads, waits)
    mixed_steps = finished = 0
    while engine.has_work:
        before = engine.stats()
        reads.clear()
        with DeviceWaits() as waits:
            finished += sum(u.finish_reason is not None for u in engine.step())
        per_step.append((len(reads), len(waits.seen)))
        after = engine.stats()
        mixed_steps += after.decode_steps > before.decode_steps and after.queued < before.queued
    assert finished == len(kinds)
    assert per_step == [(1, 0)] * len(per_step)
    assert mixed_steps  # the requests beyond the 4 rows joined while the others decoded
