"""The coordinator's inference pool against a real inference server process that is drained
(SIGTERM) and started again on the same port, again and again, busy or idle at the drain: no
request fails, and the pool takes the server back each time."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

from pipelinerl.common.channel import ChannelConfig, free_port
from pipelinerl.common.types import FinishReason, SamplingParams
from pipelinerl.coordinator.lag_gate import StreamState
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.inference.types import Completion, GenerationRequest
from tests.integration.processes import server_process

DRAINS = 3
BATCH = 24  # ~1.2 s of work at the fake engine's pace (window 4, 20 tokens of 10 ms)
TOKENS = 20


async def test_requests_outlive_drains_and_restarts_of_their_server(tmp_path: Path) -> None:
    port = free_port()

    @contextlib.asynccontextmanager
    async def server(start: int) -> AsyncIterator[subprocess.Popen[bytes]]:
        folder = tmp_path / str(start)  # a port file of its own per start
        folder.mkdir()
        async with server_process("fake_inference_server.py", folder, "64", "128", str(port)) as (proc, _):
            yield proc

    pool = InferencePool(ChannelConfig, [f"127.0.0.1:{port}"])
    await pool.start()
    sampling = SamplingParams(max_new_tokens=TOKENS)
    tasks: list[asyncio.Task[tuple[str, Completion]]] = []
    try:
        for cycle in range(DRAINS):
            async with server(cycle) as proc:
                batch = [
                    asyncio.create_task(pool.generate(GenerationRequest(f"r{cycle}-{i}", [1], sampling)))
                    for i in range(BATCH)
                ]
                tasks += batch
                if cycle % 2:  # idle at the drain: nothing of the pool's waits on the stream it ends
                    await asyncio.wait_for(asyncio.gather(*tasks), 30)
                else:  # busy: requests in flight and queued at the drain
                    await asyncio.sleep(0.3)
                    assert not all(t.done() for t in batch), "the batch ended before the drain"
                proc.send_signal(signal.SIGTERM)  # by handle: a graceful drain
                await asyncio.to_thread(proc.wait)
        async with server(DRAINS):
            completions = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pool.close()
    assert all(c.finish_reason is FinishReason.LENGTH and len(c.tokens) == TOKENS for _, c in completions)


async def test_an_episode_stays_on_its_server_and_moves_once_that_server_leaves(tmp_path: Path) -> None:
    """`generate(prefer=...)`: an episode's turns go to the server of its first turn, waiting for
    room there even while another server is idle, and go elsewhere once that server leaves."""
    ports = [free_port(), free_port()]
    sampling = SamplingParams(max_new_tokens=TOKENS)
    async with contextlib.AsyncExitStack() as stack:
        for i, port in enumerate(ports):
            folder = tmp_path / str(i)
            folder.mkdir()
            await stack.enter_async_context(
                server_process("fake_inference_server.py", folder, "64", "128", str(port))
            )
        addresses = [f"127.0.0.1:{port}" for port in ports]
        pool = InferencePool(ChannelConfig, addresses)
        await pool.start()
        stack.push_async_callback(pool.close)
        await pool.limits(30)  # both connected: a turn pinned to a server not connected yet goes anywhere
        pinned = addresses[0]
        # more turns than its window (4): the rest wait for room on it, not on the idle other one
        turns = [pool.generate(GenerationRequest(f"t{i}", [1], sampling), prefer=pinned) for i in range(12)]
        served = await asyncio.wait_for(asyncio.gather(*turns), 30)
        assert {server for server, _ in served} == {pinned}
        pool.remove(pinned)
        server, _ = await asyncio.wait_for(
            pool.generate(GenerationRequest("after", [1], sampling), prefer=pinned), 30
        )
        assert server == addresses[1]


async def test_an_evaluation_request_passes_the_lag_gate_that_holds_training_requests(tmp_path: Path) -> None:
    """A request pinned to a version (an evaluation's) is never trained on: a server the trainer has
    left behind still takes it, while a training request waits for a server within the max lag."""
    port = free_port()
    sampling = SamplingParams(max_new_tokens=TOKENS)
    async with server_process("fake_inference_server.py", tmp_path, "64", "128", str(port)):
        address = f"127.0.0.1:{port}"
        pool = InferencePool(ChannelConfig, [address])
        await pool.start()
        try:
            await pool.limits(30)
            pool.follow(StreamState(version=1000, resumed=-1, retraining=False))  # version 0 lags far
            training = asyncio.create_task(pool.generate(GenerationRequest("train", [1], sampling)))
            evaluation = GenerationRequest("eval", [1], sampling, weight_version=0)
            served, completion = await asyncio.wait_for(pool.generate(evaluation, prefer=address), 30)
            assert served == address and len(completion.tokens) == TOKENS
            await asyncio.sleep(0.5)
            assert not training.done(), "a training request went to a server the lag gate holds"
            training.cancel()
            await asyncio.gather(training, return_exceptions=True)
        finally:
            await pool.close()
