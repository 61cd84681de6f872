"""The episode table without a network: idempotent start and step, order, capacity, leases, the
time limit, and what happens when an environment's code fails or breaks the contract."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path

import pytest

from pipelinerl.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PipelineError,
    ResourceExhausted,
    Unavailable,
)
from pipelinerl.environment.episodes import EpisodeLimits, EpisodeTable
from pipelinerl.environment.loader import EnvironmentLoadError, load_environment
from pipelinerl.environment.sdk import Environment, Message, Opening, Step, Tool, ToolCall
from pipelinerl.environment.types import Role


class Counter(Environment):
    """Say the next number: the reply is the count so far; turn 3 ends it with reward 1."""

    name = "counter"
    version = "2"
    max_turns = 5
    resets = 0
    closed = 0

    def __init__(self, start: int = 0) -> None:
        self.count = start

    def reset(self, seed: int, task: str) -> Opening:
        type(self).resets += 1
        return Opening([Message.system("count"), Message.user(f"{seed}:{task}")])

    def step(self, action: Message) -> Step:
        self.count += 1
        done = self.count == 3
        return Step([Message.user(str(self.count))], {"done": float(done)}, terminated=done)

    def close(self) -> None:
        type(self).closed += 1


class AsyncEcho(Environment):
    """Async methods; the reply echoes the action, and never ends."""

    tools = (Tool("add", "a + b", {"type": "object", "properties": {"a": {}, "b": {}}}),)

    async def reset(self, seed: int, task: str) -> Opening:
        await asyncio.sleep(0)
        return Opening([Message.user("go")])

    async def step(self, action: Message) -> Step:
        replies = [Message.tool(call, "ok") for call in action.tool_calls]
        return Step(replies or [Message.user(action.content)])


def table(cls: type[Environment] = Counter, **limits: float) -> EpisodeTable:
    return EpisodeTable(cls, limits=EpisodeLimits(**limits))  # type: ignore[arg-type]


def say(text: str, *calls: ToolCall) -> Message:
    return Message.assistant(text, calls)


@pytest.fixture(autouse=True)
def _reset_counts() -> None:
    Counter.resets = Counter.closed = 0


async def test_an_episode_runs_to_its_end_and_retries_get_stored_answers() -> None:
    episodes = table()
    opening = await episodes.start("e1", 7, "t")
    assert [m.content for m in opening.messages] == ["count", "7:t"] and opening.max_turns == 5
    assert await episodes.start("e1", 7, "t") == opening and Counter.resets == 1
    first = await episodes.step("e1", 1, say("1"))
    assert first.messages[0].content == "1" and not first.ended and first.turn == 1
    assert await episodes.step("e1", 1, say("1")) == first  # a retry of the last turn
    await episodes.step("e1", 2, say("2"))
    last = await episodes.step("e1", 3, say("3"))
    assert last.terminated and last.reward == 1.0 and last.turn == 3
    await asyncio.sleep(0.05)
    assert Counter.closed == 1  # closed at its end, still held for a retry
    assert await episodes.step("e1", 3, say("3")) == last
    with pytest.raises(FailedPrecondition, match="terminated at turn 3"):
        await episodes.step("e1", 4, say("4"))
    stats = episodes.stats
    assert (stats.active_episodes, stats.episodes_started, stats.steps, stats.failures) == (1, 1, 3, 0)
    await episodes.end("e1")
    await episodes.end("e1")  # ending what is not held succeeds
    with pytest.raises(NotFound):
        await episodes.step("e1", 3, say("3"))
    assert episodes.stats.active_episodes == 0 and Counter.closed == 1


async def test_start_with_other_arguments_and_steps_out_of_order_are_refused() -> None:
    episodes = table()
    await episodes.start("e", 1, "")
    for seed, task in [(2, ""), (1, "other")]:
        with pytest.raises(FailedPrecondition):
            await episodes.start("e", seed, task)
    for turn in (2, 5):
        with pytest.raises(FailedPrecondition, match="out of order"):
            await episodes.step("e", turn, say("x"))
    await episodes.step("e", 1, say("x"))
    with pytest.raises(FailedPrecondition, match="another action"):
        await episodes.step("e", 1, say("y"))
    with pytest.raises(NotFound):
        await episodes.step("never", 1, say("x"))


async def test_a_turn_limit_truncates_the_episode() -> None:
    class Short(Counter):
        max_turns = 2

    episodes = table(Short)
    await episodes.start("e", 0, "")
    assert not (await episodes.step("e", 1, say("a"))).ended
    last = await episodes.step("e", 2, say("b"))
    assert last.truncated and not last.terminated
    with pytest.raises(FailedPrecondition, match="truncated"):
        await episodes.step("e", 3, say("c"))


async def test_async_methods_and_tool_results() -> None:
    episodes = table(AsyncEcho)
    opening = await episodes.start("e", 0, "")
    assert [t.name for t in opening.tools] == ["add"] and opening.max_turns == 0
    result = await episodes.step("e", 1, say("", ToolCall("c1", "add", '{"a": 1}')))
    [reply] = result.messages
    assert (reply.role, reply.tool_call_id, reply.name) == (Role.TOOL, "c1", "add")


async def test_capacity_refuses_a_start_until_an_episode_ends() -> None:
    episodes = table(max_episodes=2)
    await episodes.start("a", 0, "")
    await episodes.start("b", 0, "")
    with pytest.raises(ResourceExhausted):
        await episodes.start("c", 0, "")
    assert await episodes.start("a", 0, "")  # a retry is no new episode
    await episodes.step("b", 1, say("1"))  # the others are still served
    await episodes.end("a")
    await episodes.start("c", 0, "")


async def test_an_idle_episode_is_reaped_after_its_lease() -> None:
    now = [0.0]
    episodes = EpisodeTable(Counter, limits=EpisodeLimits(lease_s=10), clock=lambda: now[0])
    await episodes.start("idle", 0, "")
    await episodes.start("busy", 0, "")
    now[0] = 8.0
    await episodes.step("busy", 1, say("1"))
    now[0] = 12.0
    assert episodes.reap_idle() == ["idle"]
    with pytest.raises(NotFound):
        await episodes.step("idle", 1, say("1"))
    await episodes.step("busy", 2, say("2"))
    assert episodes.stats.episodes_reaped == 1
    await asyncio.sleep(0.05)
    assert Counter.closed == 1


async def test_the_reaper_runs_in_the_background() -> None:
    episodes = table(lease_s=0.1)
    reaper = asyncio.create_task(episodes.reap_forever())
    try:
        await episodes.start("e", 0, "")
        await asyncio.sleep(0.4)
        assert episodes.stats.active_episodes == 0 and episodes.stats.episodes_reaped == 1
    finally:
        reaper.cancel()


class Hostile(Environment):
    """Misbehaves on the turn its task names."""

    def reset(self, seed: int, task: str) -> Opening:
        if task == "raise at reset":
            raise RuntimeError("no deck of cards")
        self.task = task
        return Opening([Message.user("go")])

    def step(self, action: Message) -> Step:
        match self.task:
            case "raise":
                raise ValueError("boom")
            case "assistant":
                return Step([Message.assistant("I am the model")])
            case "huge":
                return Step([Message.user("x" * 2048)])
            case "hang":
                threading.Event().wait(30)
            case "nan":
                return Step([], {"score": math.nan})
            case "stray tool result":
                return Step([Message.tool(ToolCall("nope", "add", "{}"), "3")])
            case "not a step":
                return "higher"  # type: ignore[return-value]
            case "system":
                return Step([Message.system("new rules")])
        return Step([Message.user("fine")])


class AsyncHang(Environment):
    def reset(self, seed: int, task: str) -> Opening:
        return Opening([Message.user("go")])

    async def step(self, action: Message) -> Step:
        await asyncio.sleep(30)
        return Step()


@pytest.mark.parametrize(
    "task", ["raise", "assistant", "huge", "hang", "nan", "stray tool result", "not a step", "system"]
)
async def test_a_failing_step_ends_its_episode_alone(task: str) -> None:
    episodes = table(Hostile, max_observation_bytes=1024, step_timeout_s=0.3)
    await episodes.start("bad", 0, task)
    await episodes.start("good", 0, "")
    with pytest.raises(PipelineError) as failed:
        await episodes.step("bad", 1, say("a"))
    assert failed.value.code == "INTERNAL"
    with pytest.raises(NotFound):
        await episodes.step("bad", 1, say("a"))
    assert (await episodes.step("good", 1, say("a"))).messages[0].content == "fine"
    assert episodes.stats.failures == 1 and episodes.stats.active_episodes == 1
    await episodes.start("bad", 0, task)  # the id is free again


async def test_a_failing_reset_holds_nothing() -> None:
    episodes = table(Hostile)
    with pytest.raises(PipelineError, match="RuntimeError: no deck of cards") as failed:
        await episodes.start("e", 0, "raise at reset")
    assert failed.value.code == "INTERNAL"
    assert episodes.stats.active_episodes == 0 and episodes.stats.failures == 1


async def test_a_hung_async_step_is_cut_at_the_limit_while_others_go_on() -> None:
    episodes = table(AsyncHang, step_timeout_s=0.3)
    await episodes.start("slow", 0, "")
    hung = asyncio.create_task(episodes.step("slow", 1, say("a")))
    await episodes.start("other", 0, "")  # the loop is free meanwhile
    with pytest.raises(PipelineError, match="step_timeout_s"):
        await hung


async def test_a_retry_while_the_step_runs_waits_for_the_same_answer() -> None:
    calls = []

    class Slow(Counter):
        def step(self, action: Message) -> Step:
            calls.append(action)
            threading.Event().wait(0.2)
            return super().step(action)

    episodes = table(Slow)
    await episodes.start("e", 0, "")
    first = asyncio.create_task(episodes.step("e", 1, say("1")))
    await asyncio.sleep(0.05)
    first.cancel()  # the caller gave up; the step goes on
    again = await episodes.step("e", 1, say("1"))
    assert again.messages[0].content == "1" and len(calls) == 1
    starts = await asyncio.gather(*(episodes.start(f"s{i % 2}", 3, "") for i in range(6)))
    assert len({id(s) for s in starts}) == 2


BAD_REQUESTS = [
    ("start", ("", 0, ""), "episode_id"),
    ("start", ("a b", 0, ""), "episode_id"),
    ("start", ("x" * 129, 0, ""), "episode_id"),
    ("start", ("e", 0, "t" * (64 * 1024 + 1)), "task"),
    ("step", ("e", 0, say("a")), "turn"),
    ("step", ("e", 1, Message.user("a")), "action.role"),
    ("step", ("e/1", 1, say("a")), "episode_id"),
    ("step", ("e", 1, say("", ToolCall("", "add", "{}"))), "action.tool_calls[0].id"),
    (
        "step",
        ("e", 1, say("", ToolCall("c", "add", "{}"), ToolCall("c", "add", "{}"))),
        "action.tool_calls[1].id",
    ),
]


@pytest.mark.parametrize(("method", "args", "field"), BAD_REQUESTS)
async def test_a_malformed_request_names_its_field(method: str, args: tuple, field: str) -> None:
    episodes = table()
    await episodes.start("e", 0, "")
    with pytest.raises(InvalidArgument) as bad:
        await getattr(episodes, method)(*args)
    assert [v.field for v in bad.value.violations] == [field]


async def test_draining_refuses_new_episodes_and_answers_held_ones() -> None:
    episodes = table()
    await episodes.start("e", 0, "")
    episodes.stop_starting()
    with pytest.raises(Unavailable):
        await episodes.start("new", 0, "")
    await episodes.start("e", 0, "")
    await episodes.step("e", 1, say("1"))
    await episodes.close()
    assert Counter.closed == 1 and episodes.stats.active_episodes == 0


async def test_describe_names_the_environment_and_limits() -> None:
    info = table(AsyncEcho, max_episodes=3, lease_s=5).info
    assert (info.name, info.version, info.max_episodes, info.lease_s) == ("AsyncEcho", "0", 3, 5)
    assert table().info.name == "counter"


ENV_FILE = """
from pipelinerl.environment.sdk import Environment, Message, Opening, Step


class FromFile(Environment):
    def __init__(self, greeting: str = "hi") -> None:
        self.greeting = greeting

    def reset(self, seed, task):
        return Opening([Message.user(self.greeting)])

    def step(self, action):
        return Step(terminated=True)
"""


def test_the_loader_finds_classes_and_says_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    assert load_environment(f"{path}:FromFile", {"greeting": "yo"}).__name__ == "FromFile"
    assert load_environment("tests.unit.test_environment_episodes:Counter") is Counter
    cases = {
        f"{path}:FromFile": "do not fit",  # with an unknown argument, below
        f"{path}:Missing": "no attribute",
        f"{tmp_path}/none.py:X": "no file",
        "no.such.module:X": "cannot import",
        "builtin:chess": "no built-in environment",
        "Counter": "must be package.module:Class",
        "tests.unit.test_environment_episodes:say": "not a subclass",
    }
    for spec, reason in cases.items():
        with pytest.raises(EnvironmentLoadError, match=reason):
            load_environment(spec, {"colour": "red"})

    class BadTool(Counter):
        tools = (Tool("two words"),)

    class NoStep(Environment):
        def reset(self, seed: int, task: str) -> Opening:
            return Opening([])

    from pipelinerl.environment.loader import check_class

    for cls, reason in [(BadTool, "tool name"), (NoStep, "must define reset and step")]:
        with pytest.raises(EnvironmentLoadError, match=reason):
            check_class(cls, {})
