"""The OpenEnv adapter (`pipelinerl.environment.adapters.openenv`) through the episode table, with
openenv-core 0.3 itself: an OpenEnv environment made in this process (`OpenEnvLocal`), and the same
one behind OpenEnv's own server on 127.0.0.1 (`OpenEnvRemote`, its WebSocket sessions). Nothing
leaves the machine. Importing openenv-core (gradio, fastmcp) takes a few seconds."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("openenv.core", reason="openenv-core is not installed (the `openenv` extra)")

import uvicorn
from openenv.core.env_server import create_fastapi_app

from pipelinerl.environment.adapters.openenv import OpenEnvLocal, OpenEnvRemote
from pipelinerl.environment.episodes import EpisodeTable
from pipelinerl.environment.loader import EnvironmentLoadError, load_environment
from pipelinerl.environment.types import Message
from pipelinerl.environment.validation import EnvironmentFailed
from tests.integration.openenv_environments import SayAction, SayNumber, SayObservation

pytestmark = pytest.mark.slow
LOCAL = "tests.integration.openenv_environments:SayNumber"


def say(text: str) -> Message:
    return Message.assistant(text)


@pytest.fixture(scope="module")
def openenv_server() -> Iterator[str]:
    """OpenEnv's server for SayNumber on 127.0.0.1, in a thread; its base URL."""
    app = create_fastapi_app(SayNumber, SayAction, SayObservation, max_concurrent_envs=8)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "OpenEnv's server did not start"
        threading.Event().wait(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


async def play(episodes: EpisodeTable, episode_id: str, seed: int) -> None:
    opening = await episodes.start(episode_id, seed, "")
    assert [m.content for m in opening.messages] == [f"say {seed % 10}"] and opening.max_turns == 20
    refused = await episodes.step(episode_id, 1, say("a reply far too long"))
    assert [m.content for m in refused.messages] == ["invalid action"]
    assert refused.rewards == () and not refused.ended
    wrong = await episodes.step(episode_id, 2, say(str(seed % 10 + 1)))
    assert [m.content for m in wrong.messages] == ["no"] and wrong.reward == 0.0 and not wrong.ended
    assert [c.name for c in wrong.rewards] == ["env"]
    right = await episodes.step(episode_id, 3, say(f" {seed % 10}\n"))
    assert [m.content for m in right.messages] == ["yes"] and right.reward == 1.0 and right.terminated
    await episodes.end(episode_id)


async def test_an_openenv_environment_in_this_process() -> None:
    episodes = EpisodeTable(OpenEnvLocal, {"env": LOCAL, "observation_field": "prompt"})
    await asyncio.gather(*(play(episodes, f"local-{seed}", seed) for seed in (3, 14)))
    await episodes.start("broken", 0, "")
    with pytest.raises(EnvironmentFailed, match="broke"):
        await episodes.step("broken", 1, say("boom"))


async def test_an_openenv_server_one_session_per_episode(openenv_server: str) -> None:
    episodes = EpisodeTable(OpenEnvRemote, {"base_url": openenv_server, "turns": 5})
    opening = await episodes.start("remote-0", 7, "")
    assert opening.max_turns == 5 and opening.messages[0].content == "say 7"  # the only field
    await episodes.end("remote-0")
    episodes = EpisodeTable(OpenEnvRemote, {"base_url": openenv_server, "observation_field": "prompt"})
    await asyncio.gather(*(play(episodes, f"remote-{seed}", seed) for seed in (5, 21)))
    await episodes.start("broken", 0, "")
    with pytest.raises(EnvironmentFailed, match="broke"):
        await episodes.step("broken", 1, say("boom"))


async def test_no_server_fails_the_episode_not_the_table() -> None:
    episodes = EpisodeTable(OpenEnvRemote, {"base_url": "http://127.0.0.1:9", "connect_timeout_s": 2.0})
    with pytest.raises(EnvironmentFailed, match="connect"):
        await episodes.start("nowhere", 0, "")


def test_the_loader_checks_the_arguments() -> None:
    assert (
        load_environment("pipelinerl.environment.adapters.openenv:OpenEnvLocal", {"env": LOCAL})
        is OpenEnvLocal
    )
    with pytest.raises(EnvironmentLoadError, match="env_args"):
        load_environment("pipelinerl.environment.adapters.openenv:OpenEnvRemote", {})
    with pytest.raises(ValueError, match="no field"):
        OpenEnvLocal(env=LOCAL, action_field="text")
    with pytest.raises(TypeError, match="not an OpenEnv Environment"):
        OpenEnvLocal(env="pipelinerl.environment.builtin.guess_number:GuessNumber")
