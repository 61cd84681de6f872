"""One rank of a DeepSpeed learner world, for the tests (run under torchrun).

    python -m torch.distributed.run --nproc-per-node 2 tests/integration/zero_ranks.py \
        STAGE SAMPLES.pt OUT_DIR [--resume] [--cuda]

Rank 0 (optionally resumes from OUT_DIR/checkpoint, then) takes one step per batch in SAMPLES.pt,
writes the published weights to OUT_DIR/weights.pt and a checkpoint to OUT_DIR/checkpoint, and
closes; the other ranks follow. With `--cuda`, each rank trains on its GPU (NCCL).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch

from pipelinerl.common.model import build_preset
from pipelinerl.trainer.config import LearnerConfig, ZeroConfig
from pipelinerl.trainer.deepspeed_learner import DeepSpeedLearner
from pipelinerl.weights import buckets

LEARNER = LearnerConfig(lr=1e-3, micro_batch_tokens=64)


def main(stage: int, samples_file: Path, out: Path, resume: bool, cuda: bool) -> None:
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    loaded = build_preset("tiny", seed=0)
    if cuda:
        loaded.model.to(f"cuda:{os.environ.get('LOCAL_RANK', '0')}")
    learner = DeepSpeedLearner(loaded.model, LEARNER, ZeroConfig(stage=stage), tokenizer=loaded.tokenizer)
    if learner.rank != 0:
        learner.follow()
        return
    version = learner.load_checkpoint(out / "checkpoint") if resume else 0
    for batch in torch.load(samples_file, weights_only=False):
        metrics = learner.step(batch, version)
        version += 1
        print(f"step {version}: loss {metrics.loss:.6f} grad_norm {metrics.grad_norm:.6f}", flush=True)
    source = learner.weights_for_publish()
    specs = buckets.named_specs(source)
    packed, layout = buckets.pack(source, buckets.plan_layout(specs))
    weights = {}
    for index, bucket in enumerate(packed):
        weights.update({k: v.clone().cpu() for k, v in buckets.tensors_of(layout, index, bucket).items()})
    torch.save(weights, out / "weights.pt")
    learner.save_checkpoint(out / "checkpoint", version, {"steps": version})
    learner.close()


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        Path(sys.argv[2]),
        Path(sys.argv[3]),
        "--resume" in sys.argv[4:],
        "--cuda" in sys.argv[4:],
    )
