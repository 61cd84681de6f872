"""The real environment service (`python -m pipelinerl.environment`, a subprocess on 127.0.0.1)
through its client: episodes, retries, order, capacity, leases, hostile environments, drain, auth."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.errors import FailedPrecondition, NotFound, PipelineError, ResourceExhausted
from pipelinerl.common.health import wait_until_serving
from pipelinerl.environment.client import EnvironmentClient
from pipelinerl.environment.types import Message, Role, ToolCall
from tests.observability_docs import documented_metrics

ROOT = Path(__file__).resolve().parents[2]
SCRIPTED = "tests.integration.scripted_environments:Scripted"


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    address: str
    metrics_address: str | None
    log_path: Path

    def client(self, **config: object) -> EnvironmentClient:
        return EnvironmentClient(ChannelConfig(self.address, **config))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, *flags: str, env: str = SCRIPTED, cli: bool = False) -> AsyncIterator[Served]:
    """`python -m pipelinerl.environment --env ENV *flags` (or `pipelinerl serve environment`),
    SERVING; stopped by its handle."""
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)  # a server before this one's
    log_path = tmp_path / "environment.log"
    entry = (
        [str(Path(sys.executable).parent / "pipelinerl"), "serve", "environment"]
        if cli
        else [sys.executable, "-m", "pipelinerl.environment"]
    )
    command = [*entry, "--env", env, "--port", "0"]
    command += ["--ready-file", str(ready), *flags]
    with log_path.open("ab") as log_file:
        process = subprocess.Popen(
            command, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log_file, stderr=subprocess.STDOUT
        )
    try:
        for _ in range(600):
            if ready.exists() or process.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert ready.exists(), f"not serving; its log:\n{log_path.read_text()}"
        lines = ready.read_text().splitlines()
        metrics = lines[1].removeprefix("metrics ") if len(lines) > 1 else None
        yield Served(process, lines[0], metrics, log_path)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def say(text: str) -> Message:
    return Message.assistant(text)


async def test_an_episode_through_the_client_with_retries(tmp_path: Path) -> None:
    async with serve(tmp_path, "--metrics-port", "0") as served, served.client() as env:
        info = await env.describe()
        assert (info.name, info.version, info.max_turns) == ("scripted", "1", 5)
        assert [t.name for t in info.tools] == ["noop"] and info.lease_s == 600
        opening = await env.start("run-p0-a0", seed=7)
        assert [(m.role, m.content) for m in opening.messages] == [
            (Role.SYSTEM, "be brief"),
            (Role.USER, "seed 7"),
        ]
        assert await env.start("run-p0-a0", seed=7) == opening  # a retried start
        with pytest.raises(FailedPrecondition):
            await env.start("run-p0-a0", seed=8)
        first = await env.step("run-p0-a0", 1, say("a"))
        assert first.messages[0].content == "ok 1" and not first.ended and first.turn == 1
        assert await env.step("run-p0-a0", 1, say("a")) == first  # a retried step, turn and all
        with pytest.raises(FailedPrecondition):
            await env.step("run-p0-a0", 3, say("c"))  # turn 2 comes first
        await env.step("run-p0-a0", 2, say("b"))
        last = await env.step("run-p0-a0", 3, say("c"))
        assert last.terminated and last.reward == 1.0 and last.turn == 3
        stats = await env.status()
        assert (stats.active_episodes, stats.episodes_started, stats.steps) == (1, 1, 3)
        await env.end("run-p0-a0")
        with pytest.raises(NotFound):
            await env.step("run-p0-a0", 3, say("c"))
        assert (await env.status()).active_episodes == 0
        assert served.metrics_address is not None
        text = await asyncio.to_thread(_scrape, served.metrics_address)
    assert "pipelinerl_environment_steps_total 3.0" in text
    assert "pipelinerl_environment_step_seconds_count 3.0" in text
    exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if not line.startswith("#")}
    ours = {name.removesuffix("_bucket") for name in exposed if name.startswith("pipelinerl_environment_")}
    ours = {n for n in ours if not n.endswith(("_count", "_sum", "_created"))}
    assert ours == documented_metrics()["Environment"]


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


async def test_capacity_refuses_a_start_while_the_others_are_served(tmp_path: Path) -> None:
    async with serve(tmp_path, "--max-episodes", "2") as served, served.client() as env:
        await env.start("a")
        await env.start("b")
        with pytest.raises(ResourceExhausted):
            await env.start("c")
        assert (await env.step("a", 1, say("x"))).messages[0].content == "ok 1"
        await env.end("b")
        await env.start("c")


async def test_an_idle_episode_is_reaped_after_its_lease(tmp_path: Path) -> None:
    async with serve(tmp_path, "--lease-s", "0.5") as served, served.client() as env:
        await env.start("idle")
        await asyncio.sleep(1.5)
        with pytest.raises(NotFound):
            await env.step("idle", 1, say("x"))
        stats = await env.status()
        assert (stats.episodes_reaped, stats.active_episodes) == (1, 0)


@pytest.mark.parametrize("task", ["raise", "assistant", "huge", "hang"])
async def test_a_hostile_environment_fails_its_episode_alone(tmp_path: Path, task: str) -> None:
    async with serve(tmp_path, "--step-timeout-s", "1") as served, served.client() as env:
        await env.start("bad", task=task)
        await env.start("good")
        bad = asyncio.create_task(env.step("bad", 1, say("x"), timeout_s=20))
        for turn in (1, 2):  # the other episode goes on while the bad one fails
            assert (await env.step("good", turn, say("x"))).messages[0].content == f"ok {turn}"
        with pytest.raises(PipelineError) as failed:
            await bad
        assert failed.value.code == "INTERNAL", failed.value
        with pytest.raises(NotFound):
            await env.step("bad", 1, say("x"))
        assert (await env.step("good", 3, say("x"))).terminated
        stats = await env.status()
        assert (stats.failures, stats.active_episodes) == (1, 1)
        await env.start("bad", task="")  # its id starts afresh


async def test_drain_reports_not_serving_and_finishes_the_step_in_flight(tmp_path: Path) -> None:
    async with serve(tmp_path, "--drain-seconds", "5", "--env-args", '{"delay_s": 1.5}') as served:
        async with served.client(max_attempts=1) as env, grpc.aio.insecure_channel(served.address) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())  # pyright: ignore[reportAttributeAccessIssue]
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            await env.start("slow", task="slow")
            in_flight = asyncio.create_task(env.step("slow", 1, say("x")))
            await asyncio.sleep(0.3)
            served.process.send_signal(signal.SIGTERM)
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert (await in_flight).messages[0].content == "ok 1"
        assert await asyncio.to_thread(served.process.wait, 15) == 0


async def test_a_token_is_required_except_for_health(tmp_path: Path) -> None:
    async with serve(tmp_path, "--auth-token", "s3cret") as served:
        async with served.client(max_attempts=1) as anonymous:
            with pytest.raises(PipelineError) as denied:
                await anonymous.start("e")
            assert denied.value.code == "UNAUTHENTICATED"
            assert await anonymous.serving()
        async with served.client(auth_token="s3cret") as env:
            assert (await env.start("e")).messages
        assert await wait_until_serving(served.address, timeout_s=5)


async def test_a_class_that_cannot_be_loaded_fails_at_start(tmp_path: Path) -> None:
    for env, reason in [("tests.integration.nope:X", "cannot import"), ("builtin:chess", "no built-in")]:
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "pipelinerl.environment", "--env", env, "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert out.returncode == 2 and reason in out.stderr, out.stderr


async def test_the_built_ins_are_played_to_reward_1_by_a_scripted_player(tmp_path: Path) -> None:
    async with serve(tmp_path, env="builtin:guess_number", cli=True) as served, served.client() as env:
        assert (await env.describe()).name == "guess_number"
        for seed in range(5):
            opening = await env.start(f"g{seed}", seed=seed)
            low, high = (int(n) for n in opening.messages[0].content.removeprefix("guess ").split(" to "))
            rewards = []
            for turn in range(1, opening.max_turns + 1):
                guess = (low + high) // 2
                result = await env.step(f"g{seed}", turn, say(str(guess)))
                rewards.append(result.reward)
                if result.ended:
                    assert result.terminated
                    break
                low, high = (guess + 1, high) if result.messages[0].content == "higher" else (low, guess - 1)
            assert sum(rewards) == 1.0
            await env.end(f"g{seed}")
    async with serve(tmp_path, env="builtin:calculator") as served, served.client() as env:
        opening = await env.start("c", seed=11)
        assert [t.name for t in opening.tools] == ["add"]
        a, b = opening.messages[0].content.split("+")
        call = ToolCall("call-1", "add", f'{{"a": {a}, "b": {b}}}')
        [tool] = (await env.step("c", 1, Message.assistant("", [call]))).messages
        assert (tool.role, tool.tool_call_id, tool.content) == (Role.TOOL, "call-1", str(int(a) + int(b)))
        answered = await env.step("c", 2, say(tool.content))
        assert answered.terminated and answered.reward == 1.0
