"""Optimizer-step time of each trainer backend on the same batch, side by side.

One batch of `--samples` samples (groups of 8, prompt 16 + completion `--completion` tokens) on a
model preset; the torch learner in this process, then DeepSpeed ZeRO stages 1, 2 and 3 over
`--ranks` gloo ranks (torchrun, one thread each). Each backend takes `--steps` steps after one
warm-up step; the figure is the median. Ends with one JSON line on stdout:

    python benchmarks/trainer_step.py [--preset tiny] [--samples 64] [--completion 48] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipelinerl.common.channel import free_port
from pipelinerl.common.model import build_preset
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.trainer.config import LearnerConfig, ZeroConfig
from pipelinerl.trainer.learner import Learner, TorchLearner

GROUP = 8
PROMPT = 16
LEARNER = LearnerConfig(lr=1e-4)


def make_batch(samples: int, completion: int, vocab: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    batch = []
    for i in range(samples):
        tokens = [rng.randrange(3, vocab) for _ in range(completion)]
        logprobs = [-rng.uniform(0.5, 3.0) for _ in range(completion)]
        group_id = f"g{i // GROUP}"
        prompt = [rng.randrange(3, vocab) for _ in range(PROMPT)]
        sequence = TokenSequence(tokens, logprobs, [0] * completion)
        batch.append(Sample(f"{group_id}/{i}", group_id, prompt, sequence, float(i % 2), group_size=GROUP))
    return batch


def time_steps(learner: Learner, batch: list[Sample], steps: int) -> float:
    learner.step(batch, 0)  # warm-up
    times = []
    for version in range(1, steps + 1):
        started = time.perf_counter()
        learner.step(batch, version)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def rank_main(args: argparse.Namespace) -> None:
    """One rank of a DeepSpeed world; rank 0 writes the median step time to `--out`."""
    import deepspeed

    from pipelinerl.trainer.deepspeed_learner import DeepSpeedLearner

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_preset(args.preset, seed=0).model
    learner = DeepSpeedLearner(model, LEARNER, ZeroConfig(stage=args.stage))
    if learner.rank != 0:
        learner.follow()
        return
    batch = make_batch(args.samples, args.completion, model.config.vocab_size)
    Path(args.out).write_text(json.dumps(time_steps(learner, batch, args.steps)))
    learner.close()


def zero_step_s(args: argparse.Namespace, stage: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step_s.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
                   "--master-port", str(free_port()), __file__, "--rank", "--stage", str(stage),
                   "--preset", args.preset, "--samples", str(args.samples), "--completion",
                   str(args.completion), "--steps", str(args.steps), "--out", str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--completion", type=int, default=48)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return

    torch.set_num_threads(args.ranks)  # the same cores as the DeepSpeed world
    model = build_preset(args.preset, seed=0).model
    batch = make_batch(args.samples, args.completion, model.config.vocab_size)
    figures = {"torch_step_s": time_steps(TorchLearner(model, LEARNER), batch, args.steps)}
    for stage in (1, 2, 3):
        figures[f"zero{stage}_step_s"] = zero_step_s(args, stage)
    for stage in (1, 2, 3):
        figures[f"zero{stage}_vs_torch"] = figures[f"zero{stage}_step_s"] / figures["torch_step_s"]
    figures.update(
        preset=args.preset, samples=args.samples, completion_tokens=args.completion, ranks=args.ranks
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))


if __name__ == "__main__":
    main()
