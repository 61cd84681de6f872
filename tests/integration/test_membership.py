"""The pool's members change while requests run: servers join by registration or DNS and leave by
`leaving` or a lapsed lease without failing a request, and a member that lags the trainer by more
than its max_lag, or one still on the weights a restarted trainer left behind, takes no prompt."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import FinishReason, SamplingParams, WeightVersion
from pipelinerl.coordinator import membership as membership_module
from pipelinerl.coordinator import pool as pool_module
from pipelinerl.coordinator import server as coordinator_server
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.lag_gate import StreamState
from pipelinerl.coordinator.membership import Membership, resolve
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.types import InferenceRole
from pipelinerl.inference import server as inference_server
from pipelinerl.inference.types import GenerationRequest, InferenceStatus
from pipelinerl.trainer import server as trainer_server
from pipelinerl.trainer.client import TrainerClient
from tests.fakes import FakeBackend, FakeCoordinator, FakeTrainer

SAMPLING = SamplingParams(max_new_tokens=10)  # 10 steps of 5 ms each


@pytest.fixture
async def servers(start_server) -> Callable[[], object]:
    async def one() -> str:
        backend = FakeBackend(step_s=0.005)
        return await start_server(inference_server.registration(inference_server.InferenceServicer(backend)))

    return one


@contextlib.asynccontextmanager
async def pool_of(trainer: TrainerClient | None = None) -> AsyncIterator[InferencePool]:
    pool = InferencePool(ChannelConfig, trainer=trainer)
    await pool.start()
    try:
        yield pool
    finally:
        await pool.close()


async def batch(pool: InferencePool, prefix: str, n: int = 16) -> list[str]:
    """The server each of `n` requests ran on; every one must finish whole."""
    done = await asyncio.wait_for(
        asyncio.gather(*(pool.generate(GenerationRequest(f"{prefix}{i}", [1], SAMPLING)) for i in range(n))),
        30,
    )
    assert all(c.finish_reason is FinishReason.LENGTH and len(c.tokens) == 10 for _, c in done)
    return [address for address, _ in done]


async def test_a_registered_server_joins_and_one_leaving_finishes_its_requests_first(servers) -> None:
    a, b = await servers(), await servers()
    async with pool_of() as pool:
        members = Membership(pool, lease_s=30)
        members.register(a, leaving=False)
        assert set(await batch(pool, "one-")) == {a}
        members.register(b, leaving=False)
        assert set(await batch(pool, "two-", 32)) == {a, b}  # least loaded: both take requests
        running = asyncio.ensure_future(batch(pool, "three-", 32))
        await asyncio.sleep(0.02)
        members.register(a, leaving=True)  # mid-batch: a's requests finish, the rest go to b
        await running
        assert set(await batch(pool, "four-")) == {b}
        assert pool.members == {b}
        members.register(b, leaving=False)  # the same address again is the same member
        assert [address for address, _, _ in pool.snapshot()].count(b) == 1


async def test_a_lapsed_lease_removes_its_server(servers) -> None:
    a, b = await servers(), await servers()
    async with pool_of() as pool:
        members = Membership(pool, static=[a], refresh_s=0.1, lease_s=0.3)
        await members.start()
        try:
            members.register(b, leaving=False)
            assert pool.members == {a, b}
            await asyncio.sleep(0.6)  # b never renews
            assert pool.members == {a}
            assert set(await batch(pool, "after-")) == {a}
        finally:
            await members.close()


async def test_dns_answers_become_the_members_and_a_failed_lookup_keeps_them(
    servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await servers(), await servers()
    answers: dict[str, set[str] | OSError] = {"inference:50051": {a}}

    async def fake_resolve(name: str) -> set[str]:
        answer = answers[name]
        if isinstance(answer, OSError):
            raise answer
        return answer

    monkeypatch.setattr(membership_module, "resolve", fake_resolve)
    async with pool_of() as pool:
        members = Membership(pool, dns=["inference:50051"])
        await members.refresh()
        assert set(await batch(pool, "one-")) == {a}
        answers["inference:50051"] = {a, b}  # scaled up
        await members.refresh()
        assert set(await batch(pool, "two-", 32)) == {a, b}
        answers["inference:50051"] = OSError("temporary failure in name resolution")
        await members.refresh()
        assert pool.members == {a, b}
        answers["inference:50051"] = {b}  # scaled down
        await members.refresh()
        assert set(await batch(pool, "three-")) == {b}


async def test_a_name_resolves_to_an_address_per_record() -> None:
    assert "127.0.0.1:50051" in await resolve("localhost:50051")
    assert await resolve("[::1]:7") == {"[::1]:7"}
    with pytest.raises(InvalidArgument):
        await resolve("no-port")


async def test_a_server_behind_the_trainers_max_lag_takes_no_prompt(servers, start_server) -> None:
    a = await servers()  # the fake engine serves version 0 forever
    trainer = FakeTrainer()
    trainer.version, trainer.max_lag = 5, 2
    address = await start_server(trainer_server.registration(trainer))
    async with TrainerClient(address) as client, pool_of(client) as pool:
        pool.add(a)
        waiting = asyncio.ensure_future(batch(pool, "gated-", 2))
        await asyncio.sleep(2.5)  # the pool has polled the trainer and the server
        assert not waiting.done() and pool.version_floor == 3
        trainer.max_lag = 5  # now version 0 is within the bound
        assert set(await waiting) == {a}


class Following(FakeBackend):
    """A fake engine whose weight version the test sets, as if it had received one."""

    version = 0

    def status(self) -> InferenceStatus:
        return dataclasses.replace(super().status(), weight_version=WeightVersion(self.version, "fake"))


async def test_after_a_trainer_restart_a_server_on_the_old_weights_waits_until_it_has_new_ones(
    start_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No prompt while the restarted trainer retrains its lost steps, nor to a server still on the
    weights it had before; that server takes prompts again once its status shows the new weights
    (polled every STALE_POLL_S while it is behind: the ordinary poll is made too slow to matter)."""
    monkeypatch.setattr(pool_module, "STATUS_EVERY_S", 60.0)
    backend = Following(step_s=0.005)
    a = await start_server(inference_server.registration(inference_server.InferenceServicer(backend)))
    trainer = FakeTrainer()
    trainer.version, trainer.max_lag = 5, 4
    address = await start_server(trainer_server.registration(trainer))
    async with TrainerClient(address) as client, pool_of(client) as pool:
        backend.version = 5
        pool.add(a)
        assert set(await batch(pool, "before-", 2)) == {a}
        pool.follow(StreamState(version=7, resumed=7, retraining=True))  # restarted at 7, replaying
        waiting = asyncio.ensure_future(batch(pool, "gated-", 2))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        pool.follow(StreamState(version=9, resumed=7, retraining=False))  # replay over, `a` on 5
        await asyncio.sleep(0.5)
        assert not waiting.done() and pool.version_floor == 7
        backend.version = 9  # it has the restarted trainer's weights
        assert set(await asyncio.wait_for(waiting, 5)) == {a}


async def test_register_inference_server_over_grpc_grants_a_lease_and_names_a_bad_address(
    servers, start_server
) -> None:
    a = await servers()
    async with pool_of() as pool:
        members = Membership(pool, lease_s=12)
        address = await start_server(
            coordinator_server.registration(FakeCoordinator(), {InferenceRole.TRAINING: members})
        )
        async with CoordinatorClient(address) as coordinator:
            assert await coordinator.register_inference_server(a) == 12
            assert pool.members == {a}
            with pytest.raises(InvalidArgument) as bad:
                await coordinator.register_inference_server("no-port")
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT.name
            assert await coordinator.register_inference_server(a, leaving=True) == 0
            assert pool.members == set()
