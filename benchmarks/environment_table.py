"""CPU the environment service spends on an episode's calls, its own work only (the episode table,
no network): `--episodes` episodes, `--concurrency` at once, each started, stepped `--turns` times
and ended, for an environment whose methods are `async` (run in the event loop) and one whose
methods are plain (run on worker threads, `pipelinerl.environment.calls`), alternately
`--repeats` times in one process.

Figures (medians over the repeats): `cpu_ms_per_episode_async`, `cpu_ms_per_episode_plain` (this
process's CPU time over the episodes), `wall_ms_per_episode_async` and `_plain`. Ends with one JSON
line:

    python benchmarks/environment_table.py [--episodes 3000] [--concurrency 200] [--turns 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from pipelinerl.environment.episodes import EpisodeLimits, EpisodeTable
from pipelinerl.environment.sdk import Environment, Message, Opening, Step


class Async(Environment):
    name, version, description, max_turns = "async", "1", "async methods, instant replies", 64

    async def reset(self, seed: int, task: str) -> Opening:
        return Opening([Message.user("go")])

    async def step(self, action: Message) -> Step:
        return Step([Message.user("again")])

    async def close(self) -> None:
        pass


class Plain(Environment):
    name, version, description, max_turns = "plain", "1", "plain methods, instant replies", 64

    def reset(self, seed: int, task: str) -> Opening:
        return Opening([Message.user("go")])

    def step(self, action: Message) -> Step:
        return Step([Message.user("again")])

    def close(self) -> None:
        pass


async def play(cls: type[Environment], args: argparse.Namespace) -> tuple[float, float]:
    """(CPU ms, wall ms) per episode of `args.episodes` episodes of `cls`."""
    table = EpisodeTable(cls, {}, EpisodeLimits(max_episodes=args.concurrency))
    slots = asyncio.Semaphore(args.concurrency)
    action = Message.assistant("a move")

    async def episode(i: int) -> None:
        async with slots:
            await table.start(f"episode-{i}", i, "")
            for turn in range(1, args.turns + 1):
                await table.step(f"episode-{i}", turn, action)
            await table.end(f"episode-{i}")

    cpu, wall = time.process_time(), time.monotonic()
    await asyncio.gather(*(episode(i) for i in range(args.episodes)))
    cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    await table.close()
    return cpu * 1000 / args.episodes, wall * 1000 / args.episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").partition("\n")[0])
    parser.add_argument("--episodes", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"async": [], "plain": []}
    for _ in range(args.repeats):
        for name, cls in (("async", Async), ("plain", Plain)):
            runs[name].append(asyncio.run(play(cls, args)))
    figures: dict[str, object] = {
        "episodes": args.episodes,
        "concurrency": args.concurrency,
        "turns": args.turns,
    }
    for name, timings in runs.items():
        figures[f"cpu_ms_per_episode_{name}"] = round(statistics.median(c for c, _ in timings), 3)
        figures[f"wall_ms_per_episode_{name}"] = round(statistics.median(w for _, w in timings), 3)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
