"""Built-in engine (continuous batching) against HF `generate` with static batches, same model.

Both decode the same prompts with the same sampling (temperature 1, no top-k/top-p, EOS ignored)
and the same mixed output lengths: each request's max_new_tokens is drawn from [--min-new,
--max-new], log-uniformly by default (RL rollouts: most short, a few long) or uniformly. HF runs
static batches of `--batch` requests, each until its longest member is done, which is what static
batching costs; the engine keeps `--batch` rows busy, refilling a row as soon as its sequence ends.
Only useful tokens count: each request's own max_new_tokens. Both use `--threads` torch threads
(default 1: on a small shared machine, multi-threaded timings swing with the neighbours' load).
With `--device cuda` both run on the GPU, in `--dtype` (float32 by default), and each timing ends
with a `torch.cuda.synchronize`. `ratio` is the engine's tokens/s over HF's; `cpu_ratio` the same
over this process's CPU seconds instead of wall-clock ones, which other work on a shared machine
sways less (on CPU, with one thread; on a GPU, wall-clock is the figure).

Then the host work of a decode step, at each of `--host-rows` (8, 64, 256) full rows: that many
seeded requests (temperature 1) decode `--host-steps` steps after their prefill, each step timed
whole and its model forward timed by forward hooks (`register_forward_pre_hook` and
`register_forward_hook`, each reading the device clock). host_ms_per_step is the median over those
steps of step time minus forward time: sampling, stop checks, bookkeeping and reads to the host,
everything the model does not do. Ends with one JSON line on stdout:

    python benchmarks/engine.py [--preset small] [--requests 48] [--batch 16] [--lengths loguniform]
    python benchmarks/engine.py --device cuda --preset qwen2-0.5b --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch
from timing import clock

from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.common.model import LoadedModel, load_model
from pipelinerl.common.types import SamplingParams
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.types import GenerationRequest

log = get_logger("benchmarks.engine")

ALPHABET = "0123456789+-*/= abcdefghijklmnopqrstuvwxyz?"


def make_workload(args: argparse.Namespace, loaded: LoadedModel) -> list[tuple[list[int], int]]:
    """(prompt token ids, max_new_tokens) per request, from a fixed seed."""
    rng = random.Random(args.seed)
    workload = []
    for _ in range(args.requests):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(8, 64)))
        workload.append((loaded.tokenizer(text)["input_ids"], draw_length(rng, args)))
    return workload


def draw_length(rng: random.Random, args: argparse.Namespace) -> int:
    if args.lengths == "uniform":
        return rng.randint(args.min_new, args.max_new)
    return round(math.exp(rng.uniform(math.log(args.min_new), math.log(args.max_new))))


def run_engine(
    loaded: LoadedModel, workload: list[tuple[list[int], int]], batch: int
) -> tuple[int, float, float]:
    """Useful tokens, seconds and CPU seconds of this process for the built-in engine."""
    device = loaded.model.device
    settings = EngineSettings(device=str(device), max_running=batch, ignore_eos=True)
    engine = InferenceEngine(loaded.model, loaded.tokenizer, settings)
    started, cpu_started = clock(device), time.process_time()
    for i, (prompt, max_new) in enumerate(workload):
        engine.add_request(GenerationRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=max_new, seed=i)))
    tokens = 0
    while engine.has_work:
        tokens += sum(len(update.tokens) for update in engine.step() if update.finish_reason is not None)
    return tokens, clock(device) - started, time.process_time() - cpu_started


def host_ms_per_step(
    loaded: LoadedModel, workload: list[tuple[list[int], int]], rows: int, steps: int
) -> float:
    """Median host work of a decode step (step time minus its model forward) with `rows` rows."""
    model, device = loaded.model, loaded.model.device
    settings = EngineSettings(device=str(device), max_running=rows, ignore_eos=True)
    engine = InferenceEngine(model, loaded.tokenizer, settings)
    for i in range(rows):
        prompt = workload[i % len(workload)][0]
        engine.add_request(
            GenerationRequest(f"h{i}", prompt, SamplingParams(max_new_tokens=steps + 2, seed=i))
        )
    while engine.stats().running < rows:  # prefills, maybe over several steps
        engine.step()
    forward: list[float] = []

    def before(*_: object) -> None:
        forward.append(-clock(device))

    def after(*_: object) -> None:
        forward[-1] += clock(device)

    hooks = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    host = []
    try:
        for _ in range(steps):
            forward.clear()
            started = clock(device)
            engine.step()
            host.append(clock(device) - started - sum(forward))
    finally:
        for hook in hooks:
            hook.remove()
    return statistics.median(host) * 1e3


def run_hf(
    loaded: LoadedModel, workload: list[tuple[list[int], int]], batch: int
) -> tuple[int, float, float]:
    """Useful tokens, seconds and CPU seconds for HF `generate` on static, left-padded batches."""
    model, device, pad = loaded.model, loaded.model.device, loaded.tokenizer.pad_token_id
    started, cpu_started = clock(device), time.process_time()
    tokens = 0
    for first in range(0, len(workload), batch):
        chunk = workload[first : first + batch]
        width = max(len(prompt) for prompt, _ in chunk)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = [[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk]
        model.generate(  # pyright: ignore[reportCallIssue]  # PreTrainedModel is no GenerationMixin; its causal LMs are
            input_ids,
            attention_mask=torch.tensor(mask, device=device),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(max_new for _, max_new in chunk),
            eos_token_id=None,
            pad_token_id=pad,
        )
        tokens += sum(max_new for _, max_new in chunk)
    return tokens, clock(device) - started, time.process_time() - cpu_started


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--min-new", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=512)
    parser.add_argument("--lengths", choices=["loguniform", "uniform"], default="loguniform")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--host-rows", default="8,64,256", help="batch sizes of the host-work figures")
    parser.add_argument("--host-steps", type=int, default=16, help="decode steps timed at each")
    args = parser.parse_args()
    configure_logging("benchmark")  # stderr; stdout carries only the final JSON line
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    loaded = load_model(args.preset, dtype=getattr(torch, args.dtype), device=args.device)
    workload = make_workload(args, loaded)
    warmup = [(prompt, 4) for prompt, _ in workload[: args.batch]]
    run_engine(loaded, warmup, args.batch)
    run_hf(loaded, warmup, args.batch)

    engine_tokens, engine_s, engine_cpu_s = run_engine(loaded, workload, args.batch)
    hf_tokens, hf_s, hf_cpu_s = run_hf(loaded, workload, args.batch)
    engine_rate, hf_rate = engine_tokens / engine_s, hf_tokens / hf_s
    log.info(
        "built-in engine", tokens=engine_tokens, seconds=round(engine_s, 2), tokens_per_s=round(engine_rate)
    )
    log.info(
        "hf generate, static batches", tokens=hf_tokens, seconds=round(hf_s, 2), tokens_per_s=round(hf_rate)
    )
    host_ms = {
        rows: round(host_ms_per_step(loaded, workload, rows, args.host_steps), 3)
        for rows in map(int, args.host_rows.split(","))
    }
    log.info("host work per decode step", **{f"rows_{rows}_ms": ms for rows, ms in host_ms.items()})
    report = {
        "engine_tokens_per_s": round(engine_rate, 1),
        "hf_tokens_per_s": round(hf_rate, 1),
        "ratio": round(engine_rate / hf_rate, 2),
        "cpu_ratio": round((engine_tokens / engine_cpu_s) / (hf_tokens / hf_cpu_s), 2),
        "host_ms_per_step": {str(rows): ms for rows, ms in host_ms.items()},
        "preset": args.preset,
        "requests": args.requests,
        "batch": args.batch,
        "new_tokens": [args.lengths, args.min_new, args.max_new],
        "threads": args.threads,
        "useful_tokens": engine_tokens,
        "device": args.device,
        "dtype": args.dtype,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
