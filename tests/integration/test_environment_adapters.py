"""A Gymnasium environment served by the real environment server (`pipelinerl serve environment
--env builtin:frozen_lake`, a subprocess on 127.0.0.1) and played through its client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.environment.client import EnvironmentClient
from pipelinerl.environment.types import Message, Role

ROOT = Path(__file__).resolve().parents[2]
MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def path_to_goal(grid: list[str]) -> list[str]:
    """The moves of a shortest path from P to G that steps on no hole."""
    cells = {(r, c): ch for r, row in enumerate(grid) for c, ch in enumerate(row)}
    start = next(cell for cell, ch in cells.items() if ch == "P")
    came: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cells[cell] == "G":
            moves: list[str] = []
            while (previous := came[cell]) is not None:
                cell, move = previous
                moves.append(move)
            return moves[::-1]
        for move, (dr, dc) in MOVES.items():
            after = (cell[0] + dr, cell[1] + dc)
            if cells.get(after, "H") != "H" and after not in came:
                came[after] = (cell, move)
                queue.append(after)
    raise AssertionError(f"no path in {grid}")


async def test_frozen_lake_is_played_to_the_goal_through_the_server(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    env_args = json.dumps({"random_map": True, "turns": 16})
    command = [sys.executable, "-m", "pipelinerl.environment", "--env", "builtin:frozen_lake"]
    command += ["--env-args", env_args, "--port", "0", "--ready-file", str(ready)]
    log_path = tmp_path / "environment.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            command, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log
        )
    try:
        for _ in range(600):
            if ready.exists() or process.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert ready.exists(), f"not serving; its log:\n{log_path.read_text()}"
        address = ready.read_text().splitlines()[0]
        async with EnvironmentClient(ChannelConfig(address)) as env:
            info = await env.describe()
            assert (info.name, info.version, info.max_turns) == ("frozen_lake", "1", 10)
            for seed in range(3):
                episode = f"lake-{seed}"
                opening = await env.start(episode, seed=seed)
                assert opening.max_turns == 16
                [message] = opening.messages
                assert message.role is Role.USER
                assert await env.start(episode, seed=seed) == opening  # a retried start: the same lake
                grid = message.content.split("\n")[1:]
                first = await env.step(episode, 1, Message.assistant("north!"))
                assert [m.content for m in first.messages] == ["say one of: left, down, right, up"]
                assert first.rewards == () and not first.ended
                moves = path_to_goal(grid)
                results = [
                    await env.step(episode, turn, Message.assistant(move.upper()))
                    for turn, move in enumerate(moves, 2)
                ]
                assert (
                    await env.step(episode, len(moves) + 1, Message.assistant(moves[-1].upper()))
                    == results[-1]
                )
                assert all(not r.ended for r in results[:-1]) and results[-1].terminated
                assert [c.name for r in results for c in r.rewards] == ["env"] * len(moves)
                assert sum(r.reward for r in results) == 1.0
                assert results[-1].messages[0].content.endswith("\ngoal")
                await env.end(episode)
            stats = await env.status()
            assert (stats.episodes_started, stats.failures, stats.active_episodes) == (3, 0, 0)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
