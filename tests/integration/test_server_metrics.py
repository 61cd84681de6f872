"""The shared server bootstrap's observability, over real gRPC and HTTP on 127.0.0.1: every call
counted and timed by method and status code on `/metrics`, snapshots read in the server's event
loop, and the caller's trace ids bound to the log context of the call."""

from __future__ import annotations

import asyncio
import threading
import urllib.request
from collections.abc import Iterator

import pytest
import structlog
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import InvalidArgument, PipelineError
from pipelinerl.common.log import bind_context
from pipelinerl.common.metrics import register_snapshot
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.reward import server as reward_server
from pipelinerl.reward.client import RewardClient
from pipelinerl.reward.types import ScoreItem, ScoreResult
from tests.fakes import FakeReward


class ContextRecordingReward(FakeReward):
    """Remembers the log context each Score call ran in."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts: list[dict[str, object]] = []

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        self.contexts.append(structlog.contextvars.get_contextvars())
        return await super().score(items)


def scrape(port: int) -> dict[str, Metric]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {family.name: family for family in text_string_to_metric_families(body)}


def value(family: Metric, suffix: str = "", **labels: str) -> float:
    return sum(
        s.value
        for s in family.samples
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_calls_are_counted_by_code_and_snapshots_read_in_the_loop() -> None:
    core = ContextRecordingReward()
    server = GrpcServer(
        ServiceSettings(port=0, metrics_port=0, auth_token="s3cret", drain_seconds=0),
        [reward_server.registration(core)],
    )
    snapshot_threads: list[int] = []

    def snapshot() -> Iterator[Metric]:
        snapshot_threads.append(threading.get_ident())
        yield GaugeMetricFamily("pipelinerl_test_value", "A value read from the loop.", value=7)

    register_snapshot(server.registry, snapshot)
    await server.start()
    try:
        assert server.metrics_port is not None
        item = ScoreItem("run-p0-a0", "prompt", "42", "42", "exact")
        async with RewardClient(ChannelConfig(server.address, auth_token="s3cret")) as client:
            bind_context(run="run", group_id="run-p0")
            await client.score([item], timeout_s=10)
            with pytest.raises(InvalidArgument):
                await client.score([], timeout_s=10)
        async with RewardClient(ChannelConfig(server.address, auth_token="wrong")) as client:
            with pytest.raises(PipelineError) as refused:
                await client.score([item], timeout_s=10)
            assert refused.value.code == "UNAUTHENTICATED"
        families = await asyncio.to_thread(scrape, server.metrics_port)
    finally:
        structlog.contextvars.clear_contextvars()
        await server.stop(grace=0)

    handled = families["pipelinerl_grpc_server_handled"]
    method = {"grpc_service": "pipelinerl.reward.v1.RewardService", "grpc_method": "Score"}
    for code in ("OK", "INVALID_ARGUMENT", "UNAUTHENTICATED"):
        assert value(handled, "_total", grpc_code=code, grpc_type="unary", **method) == 1, code
    assert value(families["pipelinerl_grpc_server_started"], "_total", **method) == 3
    assert value(families["pipelinerl_grpc_server_handling_seconds"], "_count", **method) == 3
    assert value(families["pipelinerl_test_value"]) == 7
    assert snapshot_threads == [threading.get_ident()], "the snapshot ran outside the server's event loop"
    # The ids bound where the client called reached the server's log context.
    assert core.contexts[0]["run"] == "run" and core.contexts[0]["group_id"] == "run-p0"
