"""Two ranks of a DeepSpeed learner meeting bad steps, for test_deepspeed.py (run under torchrun).

    python -m torch.distributed.run --nproc-per-node 2 tests/integration/zero_faults.py STAGE OUT.json

Rank 0 steps on a sample outside the vocabulary (refused on every rank), then on rewards whose
advantages overflow float32 (a non-finite step), then on a good batch, and writes what each did.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.model import build_preset
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.trainer.config import LearnerConfig, ZeroConfig
from pipelinerl.trainer.deepspeed_learner import DeepSpeedLearner


def group(name: str, rewards: list[float]) -> list[Sample]:
    return [
        Sample(f"{name}-{i}", name, [1, 14, 15], TokenSequence([12 + i, 13], [-3.0, -3.0], [0, 0]), r)
        for i, r in enumerate(rewards)
    ]


def weights(learner: DeepSpeedLearner) -> dict[str, torch.Tensor]:
    source = learner.weights_for_publish()
    items = source.items() if isinstance(source, dict) else source.read()  # type: ignore[union-attr]
    return {name: tensor.to("cpu", copy=True) for name, tensor in items}


def main(stage: int, out: Path) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    learner = DeepSpeedLearner(
        build_preset("tiny", seed=0).model, LearnerConfig(lr=1e-3), ZeroConfig(stage=stage)
    )
    if learner.rank != 0:
        learner.follow()
        return
    report: dict[str, object] = {}
    bad = group("bad", [0.0, 1.0])
    bad[1].completion.token_ids[0] = learner.limits.vocab_size
    try:
        learner.step(bad, 0)
    except InvalidArgument as exc:
        report["refused"] = exc.violations[0].field
    before = weights(learner)
    metrics = learner.step(group("huge", [-3e38, 3e38, -3e38, 3e38]), 0)
    after = weights(learner)
    report["huge"] = {
        "stepped": metrics.stepped,
        "unchanged": all(torch.equal(before[n], after[n]) for n in before),
    }
    metrics = learner.step(group("good", [0.0, 1.0, 0.0, 1.0]), 0)
    report["good"] = {
        "stepped": metrics.stepped,
        "changed": any(not torch.equal(after[n], t) for n, t in weights(learner).items()),
    }
    out.write_text(json.dumps(report))
    learner.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), Path(sys.argv[2]))
