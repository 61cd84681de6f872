"""An environment server written in TypeScript from the protos alone
(clients/typescript/examples/guess-number-env), started by its one documented command and driven by
the Python client: the contract's rules hold for a server that shares no code with the Python one."""

from __future__ import annotations

import asyncio
import contextlib
import select
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from pipelinerl.environment.client import EnvironmentClient
from pipelinerl.environment.types import Message, Role

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "clients" / "typescript"
EXAMPLE = PACKAGE / "examples" / "guess-number-env"
SERVE = EXAMPLE / "serve.sh"
SERVICE = "pipelinerl.environment.v1.EnvironmentService"
START_TIMEOUT_S = 20.0


@dataclass
class Served:
    process: subprocess.Popen[str]
    address: str
    log_path: Path

    def client(self) -> EnvironmentClient:
        return EnvironmentClient(ChannelConfig(self.address, max_attempts=1, default_timeout_s=5))


@pytest.fixture(scope="module")
def built() -> None:
    """The package's npm dependencies (as `make clients-test` installs them) and the example compiled
    with its own tsconfig, so that a type error fails here; serve.sh then finds the build current."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: the TypeScript environment server needs Node.js 20 or later")
    if not (PACKAGE / "node_modules" / ".package-lock.json").exists():
        npm = shutil.which("npm")
        assert npm is not None, "node is installed without npm; run `npm ci` in clients/typescript"
        subprocess.run(
            [npm, "ci", "--silent", "--no-audit", "--no-fund"], cwd=PACKAGE, check=True, timeout=600
        )
    compiled = subprocess.run(
        [str(PACKAGE / "node_modules" / ".bin" / "tsc"), "-p", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert compiled.returncode == 0, compiled.stdout + compiled.stderr


@contextlib.contextmanager
def serve(log_dir: Path, *flags: str) -> Iterator[Served]:
    """`serve.sh --port 0 *flags`, its address read from the `listening HOST:PORT` line it prints;
    stopped by its handle (serve.sh execs node, so the handle is the server's)."""
    log_path = log_dir / f"server-{time.monotonic_ns()}.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [str(SERVE), "--port", "0", *flags], stdout=subprocess.PIPE, stderr=log_file, text=True
        )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        line = ""
        while not line.startswith("listening ") and process.poll() is None:
            left = deadline - time.monotonic()
            assert left > 0, f"no `listening` line within {START_TIMEOUT_S} s; log:\n{log_path.read_text()}"
            if select.select([process.stdout], [], [], left)[0]:
                line = process.stdout.readline()
        assert line.startswith("listening "), f"exited {process.poll()}; log:\n{log_path.read_text()}"
        yield Served(process, line.split()[1], log_path)
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(scope="module")
def server(built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with serve(tmp_path_factory.mktemp("tsenv"), "--max-episodes", "64") as served:
        yield served


def say(text: str) -> Message:
    return Message.assistant(text)


async def test_describe_health_and_status(server: Served) -> None:
    async with server.client() as env, grpc.aio.insecure_channel(server.address) as channel:
        info = await env.describe()
        assert (info.name, info.max_turns, info.max_episodes, info.tools) == ("guess_number", 6, 64, ())
        assert info.version and info.lease_s == 600 and info.max_observation_bytes == 1024 * 1024
        assert await env.serving()
        health = health_pb2_grpc.HealthStub(channel)
        check = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's HealthStub omits the methods its __init__ sets
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await health.Check(health_pb2.HealthCheckRequest(service="no.Such"), timeout=5)  # pyright: ignore[reportAttributeAccessIssue]
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        stats = await env.status()
        assert stats.max_episodes == 64 and stats.failures == 0


async def test_an_episode_played_to_the_end_by_binary_search(server: Served) -> None:
    secrets: set[int] = set()
    async with server.client() as env:
        for seed in range(8):
            episode = f"search-{seed}"
            opening = await env.start(episode, seed=seed)
            assert [(m.role, m.content) for m in opening.messages] == [(Role.USER, "guess 1 to 16")]
            assert opening.max_turns == 6 and await env.start(episode, seed=seed) == opening  # a retry
            low, high, turn = 1, 16, 0
            while True:
                turn += 1
                guess = (low + high) // 2
                result = await env.step(episode, turn, say(f"{guess}"))
                assert result.turn == turn  # the turn it answers
                assert await env.step(episode, turn, say(f"{guess}")) == result  # a retried step
                if result.ended:
                    break
                assert [m.role for m in result.messages] == [Role.USER] and not result.rewards
                reply = result.messages[0].content
                assert reply in ("higher", "lower")
                low, high = (guess + 1, high) if reply == "higher" else (low, guess - 1)
            assert result.terminated and not result.truncated and turn <= 5
            secrets.add(guess)
            assert [(r.name, r.value) for r in result.rewards] == [("correct", 1.0)] and not result.messages
            with pytest.raises(FailedPrecondition):
                await env.step(episode, turn + 1, say("1"))  # no turn after the last
            assert await env.step(episode, turn, say(f"{guess}")) == result  # its last turn still
            await env.end(episode)
            await env.end(episode)  # ending an episode not held succeeds
        assert len(secrets) > 1  # the secret is drawn from the seed


async def test_the_task_names_the_secret_and_the_last_turn_truncates(server: Served) -> None:
    async with server.client() as env:
        await env.start("task-11", task="11")
        replies = [
            await env.step("task-11", turn, say(text)) for turn, text in enumerate(["5", "x", "12"], 1)
        ]
        assert [r.messages[0].content for r in replies] == ["higher", "a number", "lower"]
        assert (await env.step("task-11", 4, say("it is 11"))).reward == 1.0
        await env.start("wrong", task="3")
        results = [await env.step("wrong", turn, say("16")) for turn in range(1, 7)]
        assert [(r.messages[0].content, r.truncated) for r in results] == [("lower", False)] * 5 + [
            ("lower", True)
        ]
        last = results[-1]
        assert [(r.name, r.value) for r in last.rewards] == [("correct", 0.0)] and not last.terminated
        with pytest.raises(InvalidArgument) as bad:
            await env.start("bad-task", task="17")
        assert [v.field for v in bad.value.violations] == ["task"]
        for episode in ("task-11", "wrong"):
            await env.end(episode)


async def test_order_unknown_episodes_and_malformed_requests(server: Served) -> None:
    async with server.client() as env:
        await env.start("order", seed=1)
        first = await env.step("order", 1, say("8"))
        with pytest.raises(FailedPrecondition):
            await env.step("order", 3, say("8"))  # turn 2 comes first
        with pytest.raises(FailedPrecondition):
            await env.step("order", 1, say("9"))  # the last turn with another action
        await env.step("order", 2, say("4"))
        with pytest.raises(FailedPrecondition):
            await env.step("order", 1, say("8"))  # no longer the last answered
        with pytest.raises(FailedPrecondition):
            await env.start("order", seed=2)  # the id names one episode
        assert first.messages
        with pytest.raises(NotFound):
            await env.step("never-started", 1, say("8"))
        await env.end("order")
        with pytest.raises(NotFound):
            await env.step("order", 3, say("8"))
        with pytest.raises(InvalidArgument) as bad_id:
            await env.start("no spaces")
        with pytest.raises(InvalidArgument) as bad_turn:
            await env.step("order", 0, say("8"))
        with pytest.raises(InvalidArgument) as bad_role:
            await env.step("order", 1, Message.user("8"))
        fields = [e.value.violations[0].field for e in (bad_id, bad_turn, bad_role)]
        assert fields == ["episode_id", "turn", "action.role"]


async def test_capacity_and_lease(built: None, tmp_path: Path) -> None:
    with serve(tmp_path, "--max-episodes", "2", "--lease-s", "0.5") as served:
        async with served.client() as env:
            await env.start("a")
            await env.start("b")
            with pytest.raises(ResourceExhausted):
                await env.start("c")
            assert await env.serving()  # a full server is alive
            await env.end("b")
            await env.start("c")
            await asyncio.sleep(1.5)  # both idle past their lease
            with pytest.raises(NotFound):
                await env.step("a", 1, say("8"))
            stats = await env.status()
            assert (stats.episodes_reaped, stats.active_episodes, stats.episodes_started) == (2, 0, 3)


async def test_sigterm_drains_and_exits(built: None, tmp_path: Path) -> None:
    with serve(tmp_path) as served:
        async with grpc.aio.insecure_channel(served.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())  # pyright: ignore[reportAttributeAccessIssue]
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            served.process.send_signal(signal.SIGTERM)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await asyncio.to_thread(served.process.wait, 10) == 0
