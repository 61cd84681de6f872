"""The same game trained two ways over the same seconds: as an environment whose loop the
coordinator drives (`pipelinerl run --environment NAME`: StartEpisode/StepEpisode), and as an agent
that runs its own `openai`-SDK loop against the chat-completions endpoint (`pipelinerl run --agent
NAME`: one RunEpisode per episode, every call recorded). Same model, seed, settings and wall-clock
budget; the runs go one after another, so the two cores are theirs in turn.

    python -m benchmarks.agent_vs_environment [--game guess_number] [--seeds 0,1]
        [--duration-s 180] [--env-args '{"high": 8, "turns": 4, "shaping": 0.5}']

Prints one JSON line per run (game, way, seed, reward and `correct` over the last window, samples
and episodes per second, turns per episode, forks) and a last line with the mean of each way over
the seeds and their ratio (agent / environment).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from pipelinerl.coordinator.types import RunInfo
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import launch

WAYS = ("environment", "agent")


async def one_run(way: str, game: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    settings = RunSettings(
        run_dir=out / f"{way}-seed{seed}",
        seed=seed,
        environment_args=json.loads(args.env_args),
        samples_per_step=32,
        entropy_coef=0.01,
        max_new_tokens=8,
        duration_s=args.duration_s,
        eval=[],
        **{way: game},  # type: ignore[arg-type]
    )
    last: list[RunInfo] = []
    result = await launch(settings, lambda run, _: last.append(run))
    episodes = last[-1].progress.episodes if last else None
    elapsed = result.elapsed_s
    return {
        "game": game,
        "way": way,
        "seed": seed,
        "state": result.state,
        "elapsed_s": round(elapsed, 1),
        "reward": round(result.final_reward, 3),
        "correct": round(result.final_correct, 3),
        "samples_per_s": round(result.samples_per_s, 1),
        "episodes_per_s": round(episodes.episodes / elapsed, 1) if episodes else 0.0,
        "turns_mean": round(episodes.turns_mean, 2) if episodes else 0.0,
        "forks": episodes.forks if episodes else 0,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description="an environment against an agent, the same game")
    parser.add_argument("--game", default="guess_number")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--duration-s", type=float, default=180.0)
    parser.add_argument("--env-args", default='{"high": 8, "turns": 4, "shaping": 0.5}')
    parser.add_argument(
        "--out", type=Path, default=Path("runs") / "agent_vs_environment" / time.strftime("%Y%m%d-%H%M%S")
    )
    args = parser.parse_args()
    rows = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for way in WAYS:
            row = await one_run(way, args.game, seed, args, args.out)
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary: dict[str, Any] = {"game": args.game, "duration_s": args.duration_s, "seeds": args.seeds}
    for key in ("reward", "correct", "samples_per_s"):
        means = {way: statistics.fmean(r[key] for r in rows if r["way"] == way) for way in WAYS}
        summary |= {f"{key}_{way}": round(value, 3) for way, value in means.items()}
        summary[f"{key}_ratio"] = (
            round(means["agent"] / means["environment"], 3) if means["environment"] else None
        )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
