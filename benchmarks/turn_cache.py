"""Multi-turn episodes in the built-in engine: each turn's cache kept for the next (`prompt_cache_key`)
against prefilling every turn's whole history again.

`--episodes` episodes run at once, each of `--turns` turns: an opening of `--opening` tokens, turns
of `--new` tokens (EOS ignored), each followed by an environment reply of `--reply` tokens; an
episode's next turn is submitted the step its last one ends (a coordinator stepping an environment
that answers at once, the case where prefill weighs most). The same episodes, with the same seeds,
run on an engine that keeps each turn's cache and on one that keeps none (`max_kept_caches` 0),
alternately `--repeats` times, in one process; both must draw the same tokens (checked: the run
fails otherwise). With `--device cuda` each timing ends with a `torch.cuda.synchronize`.

Figures (medians over the repeats): `seconds_per_episode_kept`, `seconds_per_episode_whole`, their
`time_ratio` (kept over whole), `cpu_ratio` (the same over this process's CPU seconds, which other
work on a shared machine sways less), `prefill_tokens_per_episode_kept` and `_whole` (the engine's
own counter: prompt tokens run through the model), `reused_share` (prompt tokens taken from kept
caches over all prompt tokens). Ends with one JSON line:

    python benchmarks/turn_cache.py [--preset tiny] [--episodes 16] [--turns 8] [--opening 64]
                                    [--new 16] [--reply 16] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass

import torch
from timing import clock

from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.common.model import LoadedModel, load_model
from pipelinerl.common.types import SamplingParams
from pipelinerl.inference.config import EngineSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.types import GenerationRequest

log = get_logger("benchmarks.turn_cache")


class Episodes:
    """The episodes' openings and replies (random token ids from a fixed seed)."""

    def __init__(self, args: argparse.Namespace, vocab: int) -> None:
        rng = random.Random(args.seed)
        ids = range(4, vocab)  # past the special tokens
        self.openings = [rng.choices(ids, k=args.opening) for _ in range(args.episodes)]
        self.replies = [
            [rng.choices(ids, k=args.reply) for _ in range(args.turns - 1)] for _ in range(args.episodes)
        ]
        self.turns, self.new = args.turns, args.new


def play(engine: InferenceEngine, episodes: Episodes) -> list[list[int]]:
    """Every episode to its end; the token ids of every turn, in the order they ended."""
    prompts = [list(opening) for opening in episodes.openings]
    turn = [0] * len(prompts)
    drawn: list[list[int]] = []

    def submit(episode: int) -> None:
        sampling = SamplingParams(max_new_tokens=episodes.new, seed=episode * 1000 + turn[episode])
        request_id = f"{episode}-{turn[episode]}"
        engine.add_request(
            GenerationRequest(request_id, prompts[episode], sampling, prompt_cache_key=str(episode))
        )

    for episode in range(len(prompts)):
        submit(episode)
    while engine.has_work:
        for update in engine.step():
            if update.finish_reason is None:
                continue
            episode = int(update.request_id.split("-")[0])
            drawn.append(update.tokens.token_ids)
            if turn[episode] + 1 < episodes.turns:
                prompts[episode] += update.tokens.token_ids + episodes.replies[episode][turn[episode]]
                turn[episode] += 1
                submit(episode)
    return drawn


@dataclass(frozen=True)
class Pass:
    """One pass over the episodes."""

    seconds: float
    cpu_seconds: float
    prefilled: int
    """Prompt tokens run through the model."""
    reused: int
    """Prompt tokens taken from kept caches."""
    drawn: list[list[int]]
    """The tokens of every turn, sorted."""


def timed(loaded: LoadedModel, episodes: Episodes, kept: int) -> Pass:
    device = loaded.model.device
    settings = EngineSettings(
        device=str(device), max_running=len(episodes.openings), max_kept_caches=kept, ignore_eos=True
    )
    engine = InferenceEngine(loaded.model, loaded.tokenizer, settings)
    started, cpu_started = clock(device), time.process_time()
    drawn = play(engine, episodes)
    seconds, cpu = clock(device) - started, time.process_time() - cpu_started
    stats = engine.stats()
    return Pass(seconds, cpu, stats.prefill_tokens, stats.reused_prompt_tokens, sorted(drawn))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--opening", type=int, default=64)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--reply", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    configure_logging("benchmark", "console", "warning")
    torch.set_num_threads(args.threads)
    loaded = load_model(args.preset, dtype=getattr(torch, args.dtype), device=args.device)
    episodes = Episodes(args, len(loaded.tokenizer))
    timed(loaded, episodes, args.episodes)  # warm-up: first-touch allocations, kernels
    runs: dict[str, list[Pass]] = {"kept": [], "whole": []}
    for _ in range(args.repeats):
        runs["kept"].append(timed(loaded, episodes, args.episodes))
        runs["whole"].append(timed(loaded, episodes, 0))
    if runs["kept"][0].drawn != runs["whole"][0].drawn:
        raise SystemExit("the engines drew different tokens: the kept caches changed what the model computes")
    n = args.episodes

    def seconds(mode: str) -> float:
        return statistics.median(run.seconds for run in runs[mode])

    def cpu(mode: str) -> float:
        return statistics.median(run.cpu_seconds for run in runs[mode])

    kept_prefill, reused = runs["kept"][0].prefilled, runs["kept"][0].reused
    figures = {
        "preset": args.preset,
        "device": args.device,
        "episodes": n,
        "turns": args.turns,
        "opening": args.opening,
        "new": args.new,
        "reply": args.reply,
        "seconds_per_episode_kept": round(seconds("kept") / n, 4),
        "seconds_per_episode_whole": round(seconds("whole") / n, 4),
        "time_ratio": round(seconds("kept") / seconds("whole"), 3),
        "cpu_ratio": round(cpu("kept") / cpu("whole"), 3),
        "prefill_tokens_per_episode_kept": round(kept_prefill / n, 1),
        "prefill_tokens_per_episode_whole": round(runs["whole"][0].prefilled / n, 1),
        "reused_share": round(reused / (reused + kept_prefill), 3),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    started = time.time()
    main()
    log.info("done", seconds=round(time.time() - started, 1))
