"""SIGTERM drains: the call in flight completes, new calls are refused, the process exits 0."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import PipelineError
from pipelinerl.reward.client import RewardClient
from pipelinerl.reward.types import ScoreItem
from tests.integration.processes import server_process


async def test_sigterm_finishes_in_flight_calls_then_exits(tmp_path: Path) -> None:
    async with server_process("slow_reward_server.py", tmp_path, "1.0") as (proc, port):
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
