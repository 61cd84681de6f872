"""Malformed and hostile requests to a real environment service (a subprocess with a bearer token):
each gets its documented status, and the server still plays an episode after it."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from pipelinerl.common.log import get_logger
from pipelinerl.environment.v1 import environment_pb2 as pb
from pipelinerl.environment.v1 import environment_pb2_grpc
from tests.integration.hostile import (
    AUTH,
    AUTH_CASES,
    BAD_UTF8,
    EXHAUSTED,
    INVALID,
    NOT_FOUND,
    OK,
    OVERSIZE_BYTES,
    PRECONDITION,
    TRUNCATED,
    UNAUTHENTICATED,
    UNDECODABLE,
    UNIMPLEMENTED,
    Harness,
    code_of,
    code_of_cut_call,
    harness,
    raw_unary,
)

log = get_logger(__name__)
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SERVICE = "/pipelinerl.environment.v1.EnvironmentService/"
MAX_EPISODES = 64
_ids = itertools.count()


def fresh_id() -> str:
    return f"ep-{next(_ids)}"


def stub(h: Harness) -> environment_pb2_grpc.EnvironmentServiceStub:
    return environment_pb2_grpc.EnvironmentServiceStub(h.channel)


def action(content: str = "a", *calls: pb.ToolCall, role: int = pb.ROLE_ASSISTANT) -> pb.Message:
    return pb.Message(role=role, content=content, tool_calls=calls)  # type: ignore[arg-type]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def environment(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    tmp = tmp_path_factory.mktemp("environment")
    args = ["--env", "tests.integration.scripted_environments:Scripted", "--max-episodes", str(MAX_EPISODES)]
    async with harness(
        "pipelinerl.environment", tmp, *args, memory_limit_gib=4, serves=plays_an_episode
    ) as h:
        yield h


async def plays_an_episode(channel: grpc.aio.Channel) -> None:
    s, episode = environment_pb2_grpc.EnvironmentServiceStub(channel), fresh_id()
    opening = await s.StartEpisode(pb.StartEpisodeRequest(episode_id=episode), metadata=AUTH, timeout=20)
    assert [m.content for m in opening.messages] == ["be brief", "seed 0"], opening
    request = pb.StepEpisodeRequest(episode_id=episode, turn=1, action=action())
    reply = await s.StepEpisode(request, metadata=AUTH, timeout=20)
    assert [m.content for m in reply.messages] == ["ok 1"], reply
    await s.EndEpisode(pb.EndEpisodeRequest(episode_id=episode), metadata=AUTH, timeout=20)


START_CASES = [
    ("empty id", pb.StartEpisodeRequest(), INVALID),
    ("id with a space", pb.StartEpisodeRequest(episode_id="a b"), INVALID),
    ("id with a slash", pb.StartEpisodeRequest(episode_id="a/b"), INVALID),
    ("id with NUL", pb.StartEpisodeRequest(episode_id="a\x00"), INVALID),
    ("id of 129 characters", pb.StartEpisodeRequest(episode_id="x" * 129), INVALID),
    ("id of 128 characters", pb.StartEpisodeRequest(episode_id="y" * 128), OK),
    ("id not ASCII", pb.StartEpisodeRequest(episode_id="épisode"), INVALID),
    ("task over 64 KiB", pb.StartEpisodeRequest(episode_id="t1", task="t" * (64 * 1024 + 1)), INVALID),
    ("largest seed", pb.StartEpisodeRequest(episode_id="s1", seed=2**64 - 1), OK),
]


@pytest.mark.parametrize(("name", "request_", "code"), START_CASES, ids=[c[0] for c in START_CASES])
async def test_malformed_start(
    environment: Harness, name: str, request_: pb.StartEpisodeRequest, code: grpc.StatusCode
) -> None:
    call = stub(environment).StartEpisode(request_, metadata=AUTH, timeout=20)
    await environment.expect(code_of(call), code)
    if code == OK:
        end = pb.EndEpisodeRequest(episode_id=request_.episode_id)
        await stub(environment).EndEpisode(end, metadata=AUTH, timeout=20)


def call(call_id: str, name: str = "noop", arguments: str = "{}") -> pb.ToolCall:
    return pb.ToolCall(id=call_id, name=name, arguments=arguments)


STEP_CASES = [
    ("no action", {"turn": 1}, INVALID),
    ("action from the user", {"turn": 1, "action": action(role=pb.ROLE_USER)}, INVALID),
    ("action from a tool", {"turn": 1, "action": action(role=pb.ROLE_TOOL)}, INVALID),
    ("unknown role", {"turn": 1, "action": action(role=99)}, INVALID),
    ("turn 0", {"turn": 0, "action": action()}, INVALID),
    ("negative turn", {"turn": -1, "action": action()}, INVALID),
    ("turn far ahead", {"turn": 2**31 - 1, "action": action()}, PRECONDITION),
    ("tool call without id", {"turn": 1, "action": action("", call(""))}, INVALID),
    ("tool call ids repeated", {"turn": 1, "action": action("", call("c"), call("c"))}, INVALID),
    ("257 tool calls", {"turn": 1, "action": action("", *(call(f"c{i}") for i in range(257)))}, INVALID),
    ("tool call of an unknown tool", {"turn": 1, "action": action("", call("c", "rm -rf /"))}, OK),
    ("tool call arguments not JSON", {"turn": 1, "action": action("", call("c", "noop", "{"))}, OK),
    ("NUL and control bytes", {"turn": 1, "action": action("\x00\x01\x1b[2J")}, OK),
]


@pytest.mark.parametrize(("name", "fields", "code"), STEP_CASES, ids=[c[0] for c in STEP_CASES])
async def test_malformed_step(environment: Harness, name: str, fields: dict, code: grpc.StatusCode) -> None:
    episode = fresh_id()
    await stub(environment).StartEpisode(
        pb.StartEpisodeRequest(episode_id=episode), metadata=AUTH, timeout=20
    )
    request = pb.StepEpisodeRequest(episode_id=episode, **fields)
    try:
        await environment.expect(
            code_of(stub(environment).StepEpisode(request, metadata=AUTH, timeout=20)), code
        )
    finally:
        await stub(environment).EndEpisode(
            pb.EndEpisodeRequest(episode_id=episode), metadata=AUTH, timeout=20
        )


@pytest.mark.parametrize(
    ("name", "request_", "code"),
    [
        (
            "step of an episode never started",
            pb.StepEpisodeRequest(episode_id="nope", turn=1, action=action()),
            NOT_FOUND,
        ),
        ("step with an empty id", pb.StepEpisodeRequest(turn=1, action=action()), INVALID),
    ],
)
async def test_unknown_episode(
    environment: Harness, name: str, request_: pb.StepEpisodeRequest, code: grpc.StatusCode
) -> None:
    await environment.expect(
        code_of(stub(environment).StepEpisode(request_, metadata=AUTH, timeout=20)), code
    )


@pytest.mark.parametrize(("episode_id", "code"), [("", INVALID), ("never-started", OK), ("a b", INVALID)])
async def test_end(environment: Harness, episode_id: str, code: grpc.StatusCode) -> None:
    request = pb.EndEpisodeRequest(episode_id=episode_id)
    await environment.expect(code_of(stub(environment).EndEpisode(request, metadata=AUTH, timeout=20)), code)


RAW_CASES = [
    ("StartEpisode", UNDECODABLE, INVALID),
    ("StartEpisode", TRUNCATED, INVALID),
    ("StartEpisode", BAD_UTF8, INVALID),  # episode_id is not UTF-8
    ("StepEpisode", UNDECODABLE, INVALID),
    ("StepEpisode", b"\x1a\x03\x08\x03\x12", INVALID),  # action's content cut short
    ("EndEpisode", TRUNCATED, INVALID),
    ("DescribeEnvironment", UNDECODABLE, INVALID),
    ("GetStatus", UNDECODABLE, INVALID),
    ("DescribeEnvironment", b"\xf8\x06\x01", OK),  # an unknown field 111 is ignored
    ("Nope", b"", UNIMPLEMENTED),
]


@pytest.mark.parametrize(
    ("method", "data", "code"), RAW_CASES, ids=[f"{m}-{d.hex()}" for m, d, _ in RAW_CASES]
)
async def test_raw_bytes(environment: Harness, method: str, data: bytes, code: grpc.StatusCode) -> None:
    await environment.expect(raw_unary(environment.channel, SERVICE + method, data), code)


METHODS = ["DescribeEnvironment", "StartEpisode", "StepEpisode", "EndEpisode", "GetStatus"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("auth", sorted(AUTH_CASES))
async def test_bad_token(environment: Harness, method: str, auth: str) -> None:
    data = pb.StartEpisodeRequest(episode_id="x").SerializeToString() if method == "StartEpisode" else b""
    code = raw_unary(environment.channel, SERVICE + method, data, AUTH_CASES[auth])
    await environment.expect(code, UNAUTHENTICATED)


@pytest.mark.parametrize(
    "method", ["DescribeEnvironment", "StartEpisode", "StepEpisode", "EndEpisode", "GetStatus"]
)
async def test_request_cut_by_end_of_stream_is_invalid(environment: Harness, method: str) -> None:
    await environment.expect(code_of_cut_call(environment.service.port, SERVICE + method), INVALID)


async def test_oversize_message_is_resource_exhausted(environment: Harness) -> None:
    request = pb.StepEpisodeRequest(episode_id="big", turn=1, action=action("x" * OVERSIZE_BYTES))
    await environment.expect(
        code_of(stub(environment).StepEpisode(request, metadata=AUTH, timeout=30)), EXHAUSTED
    )


async def test_a_flood_of_starts_is_held_to_max_episodes(environment: Harness) -> None:
    ids = [f"flood-{i}" for i in range(MAX_EPISODES * 2)]
    codes = await asyncio.gather(
        *(
            code_of(
                stub(environment).StartEpisode(
                    pb.StartEpisodeRequest(episode_id=i), metadata=AUTH, timeout=20
                )
            )
            for i in ids
        )
    )
    assert codes.count(OK) == MAX_EPISODES and codes.count(EXHAUSTED) == MAX_EPISODES
    status = await stub(environment).GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=20)
    assert status.active_episodes == MAX_EPISODES
    await asyncio.gather(
        *(
            stub(environment).EndEpisode(pb.EndEpisodeRequest(episode_id=i), metadata=AUTH, timeout=20)
            for i in ids
        )
    )
    await environment.still_serving()


async def test_thousands_of_abandoned_steps_leave_rss_bounded(environment: Harness) -> None:
    episode = fresh_id()
    await stub(environment).StartEpisode(
        pb.StartEpisodeRequest(episode_id=episode), metadata=AUTH, timeout=20
    )

    async def abandon(count: int) -> None:
        async with environment.service.channel() as channel:
            s = environment_pb2_grpc.EnvironmentServiceStub(channel)
            request = pb.StepEpisodeRequest(episode_id=episode, turn=2**30, action=action())
            for _ in range(count // 250):
                calls = [s.StepEpisode(request, metadata=AUTH, timeout=30) for _ in range(250)]
                await asyncio.sleep(0.01)
                for c in calls:
                    c.cancel()
                await asyncio.gather(*calls, return_exceptions=True)

    await abandon(250)
    before = environment.service.rss_mb()
    started = time.monotonic()
    await abandon(2000)
    elapsed_s, growth_mb = time.monotonic() - started, environment.service.rss_mb() - before
    log.info("abandoned calls", elapsed_s=round(elapsed_s, 1), rss_growth_mb=round(growth_mb, 1))
    await environment.still_serving_after_a_flood()
    assert elapsed_s < 60 and growth_mb < 50, (elapsed_s, growth_mb)
