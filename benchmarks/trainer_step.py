"""Optimizer-step time of each trainer backend on the same batch, side by side.

One batch of `--samples` samples (groups of 8, prompt 16 + completion `--completion` tokens) on a
model preset; the torch learner in this process, then DeepSpeed ZeRO stages 1, 2 and 3 over
`--ranks` gloo ranks (torchrun, one thread each). Each backend takes `--steps` steps after one
warm-up step; the figure is the median. Ends with one JSON line on stdout:

    python benchmarks/trainer_step.py [--preset tiny] [--samples 64] [--completion 48] [--ranks 2]

With `--packing`, the torch learner padded against packed (`LearnerConfig.packing`) instead, on two
step shapes drawn as the built-in tasks draw them, 128 samples in groups of 8: the long tail
(`builtin:repeat`, prompt and answer of 1-128 digits, each attempt's length within a quarter of
the answer's) and the copy task (`builtin:copy:2`, 3-token answers, each attempt 2-4 tokens). Each
shape is timed on one thread, the two modes alternating step by step (`--repeats` × `--steps`
pairs); a ratio is the median of the pairs' ratios (with its quartiles), in wall-clock time and in
the process's CPU time (which load from other processes disturbs less). Peak memory: the bytes the forward
keeps for the backward (activations, the largest micro-batch's), counted by autograd's saved-tensor
hooks, and on CUDA `max_memory_allocated` of a step:

    python benchmarks/trainer_step.py --packing [--repeats 5] [--steps 3] [--device cpu]
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
from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.coordinator.tasks import builtin_problems
from pipelinerl.trainer.advantages import compute_advantages
from pipelinerl.trainer.config import AdvantageConfig, LearnerConfig, ZeroConfig
from pipelinerl.trainer.learner import Learner, TorchLearner
from pipelinerl.trainer.losses import policy_loss

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


def task_batch(task: str, size: int, samples: int, seed: int = 0) -> list[Sample]:
    """`samples` attempts in groups of 8 at prompts drawn as `builtin:<task>:<size>` draws them:
    prompt `<bos>` + the problem, each attempt the answer and `<eos>`, its length moved by up to a
    quarter of the answer's (at least one token) as a policy's attempts differ."""
    tokenizer = build_tokenizer()
    rng = random.Random(seed)
    problems = builtin_problems(task, size, seed)
    batch = []
    for g in range(samples // GROUP):
        problem = next(problems)
        prompt = tokenizer(problem.prompt)["input_ids"]
        gold = len(problem.answer) + 1
        for a in range(GROUP):
            spread = max(1, gold // 4)
            length = max(1, min(size + 1, gold + rng.randint(-spread, spread)))
            tokens = [rng.randrange(3, len(tokenizer)) for _ in range(length)]
            logprobs = [-rng.uniform(0.5, 3.0) for _ in range(length)]
            sequence = TokenSequence(tokens, logprobs, [0] * length)
            batch.append(Sample(f"g{g}/{a}", f"g{g}", prompt, sequence, float(a % 2), group_size=GROUP))
    return batch


def peak_memory(learner: TorchLearner, batch: list[Sample]) -> dict[str, float]:
    """MiB the largest micro-batch's forward keeps for its backward (each storage once), and on CUDA
    the step's `max_memory_allocated`."""
    advantages = compute_advantages(batch, AdvantageConfig()).advantages
    plan = learner._plan(batch, advantages, 0)
    peak = 0
    for micro_batch in plan.micro_batches:
        saved: dict[int, int] = {}

        def keep(tensor: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
            storage = tensor.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            output = policy_loss(
                learner._loss_inputs(micro_batch.to(learner.device)), learner.config.loss, plan.totals
            )
        output.loss.backward()
        peak = max(peak, sum(saved.values()))
    learner.model.zero_grad(set_to_none=True)
    figures = {"activations_mib": peak / 2**20}
    if learner.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(learner.device)
        learner.step(batch, 0)
        figures["cuda_peak_mib"] = torch.cuda.max_memory_allocated(learner.device) / 2**20
    return figures


def packing_figures(args: argparse.Namespace) -> dict[str, object]:
    """Padded against packed on the long-tail and copy step shapes, side by side."""
    torch.set_num_threads(1)
    shapes = {
        "long_tail": task_batch("repeat", 128, args.samples),
        "copy": task_batch("copy", 2, args.samples),
    }
    learners = {
        mode: TorchLearner(
            build_preset(args.preset, seed=0).model.to(args.device),
            LearnerConfig(lr=1e-4, packing=mode == "packed"),
        )
        for mode in ("padded", "packed")
    }
    figures: dict[str, object] = {}
    for shape, batch in shapes.items():
        for learner in learners.values():
            learner.step(batch, 0)  # warm-up
        # One step of each mode in turn, so that a burst of load on the box falls on both alike.
        wall: dict[str, list[float]] = {"padded": [], "packed": []}
        cpu: dict[str, list[float]] = {"padded": [], "packed": []}
        for version in range(1, args.repeats * args.steps + 1):
            for mode, learner in learners.items():
                started, started_cpu = time.perf_counter(), time.process_time()
                learner.step(batch, version)
                wall[mode].append(time.perf_counter() - started)
                cpu[mode].append(time.process_time() - started_cpu)
        for name, times in (("", wall), ("_cpu", cpu)):
            ratios = [b / a for a, b in zip(times["padded"], times["packed"], strict=True)]
            figures[f"packed_over_padded_{shape}{name}"] = statistics.median(ratios)
            figures[f"packed_over_padded_{shape}{name}_quartiles"] = [
                round(q, 3) for q in statistics.quantiles(ratios, n=4)[::2]
            ]
        for mode, learner in learners.items():
            figures[f"{mode}_step_s_{shape}"] = statistics.median(wall[mode])
            figures[f"{mode}_step_cpu_s_{shape}"] = statistics.median(cpu[mode])
            for name, value in peak_memory(learner, batch).items():
                figures[f"{mode}_{name}_{shape}"] = value
        figures[f"tokens_{shape}"] = sum(len(s.prompt_token_ids) + len(s.completion) for s in batch)
    figures.update(
        preset=args.preset, samples=args.samples, repeats=args.repeats, threads=1, device=args.device
    )
    return figures


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
    parser.add_argument("--packing", action="store_true", help="padded vs packed, long-tail and copy shapes")
    parser.add_argument("--repeats", type=int, default=5, help="--packing: alternations of the two modes")
    parser.add_argument("--device", default="cpu", help="--packing: cpu or cuda")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        rank_main(args)
        return
    if args.packing:
        if args.samples == parser.get_default("samples"):
            args.samples = 128
        figures = packing_figures(args)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}))
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
