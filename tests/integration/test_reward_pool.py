"""Score calls spread over reward replicas: the least loaded replica that is up takes each call; a
call a replica fails (gone, killed, too slow) goes whole to another and its results are read from
one reply only; a removed replica takes nothing new; with no replica up, calls wait and the
coordinator's health says NOT_SERVING until one is back."""

from __future__ import annotations

import asyncio
import contextlib
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl.common.channel import ChannelConfig, free_port, open_channel
from pipelinerl.common.errors import Unavailable
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.coordinator import membership as membership_module
from pipelinerl.coordinator import replicas as replicas_module
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.coordinator.membership import Membership
from pipelinerl.coordinator.reward_pool import RewardPool
from pipelinerl.reward import server as reward_server
from pipelinerl.reward.types import ScoreItem, ScoreResult, VerifierDetail
from tests.fakes import FakeReward

SERVICE = "pipelinerl.coordinator.v1.CoordinatorService"


class Replica(FakeReward):
    """A reward replica that records every batch it scored and signs its results with its name."""

    def __init__(self, name: str, delay_s: float = 0.0) -> None:
        super().__init__(delay_s)
        self.name = name
        self.scored: list[str] = []
        """Sample ids of the batches it finished scoring, whether or not the reply was read."""
        self.fail = False

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        if self.fail:
            raise Unavailable(f"{self.name} cannot score now")
        results = await super().score(items)
        self.scored += [i.sample_id for i in items]
        return [
            ScoreResult(r.sample_id, r.reward, [VerifierDetail("exact", 1.0, 1.0, self.name)])
            for r in results
        ]


Start = Callable[..., Awaitable[tuple[str, GrpcServer]]]


@pytest.fixture
async def replicas() -> AsyncIterator[Start]:
    """`address, server = await start(replica, port=0)`; stopped after the test."""
    servers: list[GrpcServer] = []

    async def start(replica: Replica, port: int = 0) -> tuple[str, GrpcServer]:
        settings = ServiceSettings(host="127.0.0.1", port=port, drain_seconds=0)
        server = GrpcServer(settings, [reward_server.registration(replica)])
        await server.start()
        servers.append(server)
        return server.address, server

    yield start
    for server in servers:
        await server.stop(grace=0)


@contextlib.asynccontextmanager
async def pool_of(*addresses: str) -> AsyncIterator[RewardPool]:
    pool = RewardPool(ChannelConfig, addresses)
    await pool.start()
    try:
        await all_up(pool)
        yield pool
    finally:
        await pool.close()


async def all_up(pool: RewardPool) -> None:
    async def until() -> None:
        while not all(s.up for s in pool.snapshot()):
            await asyncio.sleep(0.01)

    await asyncio.wait_for(until(), 5)


@pytest.fixture(autouse=True)
def quick_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas_module, "PROBE_S", 0.1)
    monkeypatch.setattr(replicas_module, "MAX_PROBE_S", 0.2)


def batch(prefix: str, n: int = 3) -> list[ScoreItem]:
    return [ScoreItem(f"{prefix}-{i}", "p", "4", "4", "exact") for i in range(n)]


def scored_by(results: list[ScoreResult]) -> str:
    """The replica whose reply these results are; every result of a reply names the same one."""
    [name] = {r.details[0].message for r in results}
    return name


async def test_each_call_goes_to_the_replica_with_the_fewest_calls_in_flight(replicas: Start) -> None:
    slow, fast = Replica("slow", delay_s=1.0), Replica("fast", delay_s=0.02)
    (a, _), (b, _) = await replicas(slow), await replicas(fast)
    async with pool_of(a, b) as pool:
        # Two at once: one each. Then, while the slow one still holds its call, every call goes to
        # the idle fast one.
        first = await asyncio.gather(pool.score(batch("x"), 10), pool.score(batch("y"), 10))
        assert sorted(scored_by(r) for r in first) == ["fast", "slow"]
        held = asyncio.ensure_future(pool.score(batch("held"), 10))
        await asyncio.sleep(0.05)
        assert {s.address: s.in_flight for s in pool.snapshot()} == {a: 1, b: 0}
        for i in range(5):
            assert scored_by(await pool.score(batch(f"next{i}"), 10)) == "fast"
        assert scored_by(await held) == "slow"
        assert pool.retries == 0


async def test_a_failed_call_is_sent_whole_to_another_replica_and_read_from_one_reply(
    replicas: Start,
) -> None:
    broken, healthy = Replica("broken"), Replica("healthy")
    (a, _), (b, _) = await replicas(broken), await replicas(healthy)
    broken.fail = True  # its health says SERVING, its Score calls fail
    async with pool_of(a, b) as pool:
        results = await asyncio.gather(*(pool.score(batch(f"b{i}"), 10) for i in range(4)))
        for i, result in enumerate(results):
            assert [r.sample_id for r in result] == [f"b{i}-{j}" for j in range(3)]
            assert scored_by(result) == "healthy"
        assert pool.retries >= 1  # at least the first call, sent to `broken`, went again
        assert Counter(healthy.scored) == Counter(f"b{i}-{j}" for i in range(4) for j in range(3))


async def test_a_lone_replica_failing_every_call_is_tried_less_and_less_until_it_answers(
    replicas: Start,
) -> None:
    broken = Replica("broken")
    (a, _) = await replicas(broken)
    broken.fail = True  # its health says SERVING, its Score calls fail
    async with pool_of(a) as pool:
        call = asyncio.ensure_future(pool.score(batch("r"), 10))
        await asyncio.sleep(1.5)  # held down 0.1, 0.2, 0.2, ... s after each failure, plus a check
        assert not call.done() and 3 <= pool.retries <= 12, pool.retries
        broken.fail = False
        assert scored_by(await asyncio.wait_for(call, 5)) == "broken"


async def test_a_call_past_its_deadline_on_one_replica_is_answered_by_another(
    replicas: Start,
) -> None:
    hung, quick = Replica("hung", delay_s=1.0), Replica("quick")
    (a, _), (b, _) = await replicas(hung), await replicas(quick)
    async with pool_of(a, b) as pool:
        pool.remove(b)  # the first call can only go to `hung`
        call = asyncio.ensure_future(pool.score(batch("late"), 0.3))
        await asyncio.sleep(0.1)
        pool.add(b)
        assert scored_by(await call) == "quick"
        assert pool.retries == 1
        assert Counter(quick.scored) == Counter(f"late-{j}" for j in range(3))


async def test_a_killed_replica_loses_no_batch_and_takes_no_more_calls(replicas: Start) -> None:
    doomed, survivor = Replica("doomed", delay_s=0.5), Replica("survivor", delay_s=0.5)
    (a, doomed_server), (b, _) = await replicas(doomed), await replicas(survivor)
    async with pool_of(a, b) as pool:
        # Four requests made together leave as one call per replica, two requests in each.
        calls = [asyncio.ensure_future(pool.score(batch(f"k{i}"), 10)) for i in range(4)]
        await asyncio.sleep(0.1)
        assert {s.address: s.in_flight for s in pool.snapshot()} == {a: 1, b: 1}
        assert pool.calls == 2
        await doomed_server.stop(grace=0)  # its calls in flight die with it
        results = await asyncio.gather(*calls)
        assert all(scored_by(r) == "survivor" for r in results)
        assert doomed.scored == []
        assert Counter(survivor.scored) == Counter(f"k{i}-{j}" for i in range(4) for j in range(3))
        assert pool.reachable
        after = [await pool.score(batch(f"after{i}"), 10) for i in range(3)]
        assert all(scored_by(r) == "survivor" for r in after)
        assert [s.up for s in pool.snapshot() if s.address == a] == [False]


async def test_a_replica_gone_from_dns_finishes_its_call_and_takes_no_new_one(
    replicas: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    leaving, staying = Replica("leaving", delay_s=0.5), Replica("staying")
    (a, _), (b, _) = await replicas(leaving), await replicas(staying)
    answers = {"reward:50053": {a, b}}

    async def fake_resolve(name: str) -> set[str]:
        return answers[name]

    monkeypatch.setattr(membership_module, "resolve", fake_resolve)
    pool = RewardPool(ChannelConfig)
    await pool.start()
    members = Membership(pool, dns=["reward:50053"], role="reward")
    try:
        await members.refresh()
        await all_up(pool)
        in_flight = [asyncio.ensure_future(pool.score(batch(f"d{i}"), 10)) for i in range(2)]
        await asyncio.sleep(0.1)
        assert {s.address: s.in_flight for s in pool.snapshot()} == {a: 1, b: 0}
        answers["reward:50053"] = {b}  # scaled down
        await members.refresh()
        assert pool.members == {b}
        results = await asyncio.gather(*in_flight)
        assert sorted(scored_by(r) for r in results) == ["leaving", "staying"]  # read, once each
        for i in range(4):
            assert scored_by(await pool.score(batch(f"after{i}"), 10)) == "staying"
        await asyncio.sleep(0.2)
        assert [s.address for s in pool.snapshot()] == [b]  # left once its call was done
        assert pool.retries == 0
    finally:
        await members.close()
        await pool.close()


async def test_with_no_replica_up_a_call_waits_until_one_comes_back(replicas: Start) -> None:
    port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        pool = RewardPool(ChannelConfig, [f"127.0.0.1:{port}"])
        await pool.start()
        stack.push_async_callback(pool.close)
        call = asyncio.ensure_future(pool.score(batch("wait"), 10))
        await asyncio.sleep(0.5)
        assert not pool.reachable and not call.done()
        await replicas(Replica("late"), port=port)
        assert scored_by(await asyncio.wait_for(call, 5)) == "late"
        assert pool.reachable


async def health(address: str, service: str = "") -> int:
    channel = open_channel(ChannelConfig(address, max_attempts=1))
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)  # pyright: ignore[reportAttributeAccessIssue]
        return response.status
    finally:
        await channel.close()


async def metrics(server: GrpcServer) -> str:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    return await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())


async def wait_health(address: str, status: int, timeout_s: float = 10) -> None:
    async def until() -> None:
        while await health(address) != status:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(until(), timeout_s)


async def test_the_coordinator_is_not_serving_while_no_reward_replica_is_reachable(
    tmp_path: Path, replicas: Start
) -> None:
    from pipelinerl.coordinator.__main__ import build

    port, nowhere = free_port(), f"127.0.0.1:{free_port()}"
    settings = CoordinatorSettings(
        port=0, inference_addresses=[], reward_address=f"127.0.0.1:{port}", trainer_address=nowhere,
        journal_path=tmp_path / "journal.sqlite", drain_seconds=0, metrics_port=0,
    )  # fmt: skip
    coordinator = await build(settings)
    await coordinator.start()
    try:
        address = coordinator.address
        await wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await health(address, SERVICE) == health_pb2.HealthCheckResponse.SERVING  # alive
        replica = f'replica="127.0.0.1:{port}"'
        assert f"pipelinerl_coordinator_reward_replica_up{{{replica}}} 0.0" in await metrics(coordinator)
        _, reward = await replicas(Replica("r"), port=port)
        await wait_health(address, health_pb2.HealthCheckResponse.SERVING)
        assert f"pipelinerl_coordinator_reward_replica_up{{{replica}}} 1.0" in await metrics(coordinator)
        await reward.stop(grace=0)
        await wait_health(address, health_pb2.HealthCheckResponse.NOT_SERVING)
        assert await health(address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await coordinator.stop(grace=0)
