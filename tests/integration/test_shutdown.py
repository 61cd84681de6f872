"""SIGTERM drains: the call in flight completes, new calls are refused, the process exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import PipelineError
from pipelinerl.reward.client import RewardClient
from pipelinerl.reward.types import ScoreItem

ROOT = Path(__file__).resolve().parents[2]


async def wait_for_file(path: Path, timeout_s: float) -> str:
    for _ in range(int(timeout_s * 20)):
        if path.exists() and path.read_text():
            return path.read_text()
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{path} not written within {timeout_s}s")


async def test_sigterm_finishes_in_flight_calls_then_exits(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "tests" / "integration" / "slow_reward_server.py"
    proc = subprocess.Popen([sys.executable, str(script), str(port_file), "1.0"], env=env)
    try:
        port = await wait_for_file(port_file, timeout_s=30)
        config = ChannelConfig(f"127.0.0.1:{port}", max_attempts=1)
        async with RewardClient(config) as client:
            in_flight = asyncio.create_task(client.score([ScoreItem("a", "p", "4", "4", "exact")]))
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            with pytest.raises(PipelineError) as refused:
                await client.score([ScoreItem("b", "p", "4", "4", "exact")], timeout_s=5)
            assert refused.value.code == "UNAVAILABLE"
            [result] = await in_flight
            assert result.reward == 1.0
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
