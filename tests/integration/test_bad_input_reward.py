"""Malformed and hostile requests to a real reward service (a subprocess with a bearer token): each
gets its documented status, whole-call or per-item, and the server still scores a valid item after it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from pipelinerl.common.log import get_logger
from pipelinerl.reward.v1 import reward_pb2 as pb
from pipelinerl.reward.v1 import reward_pb2_grpc
from tests.integration.hostile import (
    AUTH,
    AUTH_CASES,
    BAD_UTF8,
    DEADLINE,
    EXHAUSTED,
    INVALID,
    OK,
    OVERSIZE_BYTES,
    TRUNCATED,
    UNAUTHENTICATED,
    UNDECODABLE,
    UNIMPLEMENTED,
    Harness,
    code_of,
    code_of_cut_call,
    code_value,
    harness,
    raw_unary,
)

log = get_logger(__name__)
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SERVICE = "/pipelinerl.reward.v1.RewardService/"
MAX_COMPLETION_CHARS = 64 * 1024
DEADLINE_VALUE = code_value(DEADLINE)


def item(
    sample_id: str = "s", completion: str = "4", answer: str = "4", verifier: str = "exact"
) -> pb.ScoreItem:
    return pb.ScoreItem(
        sample_id=sample_id, prompt="2+2=", completion=completion, answer=answer, verifier=verifier
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def reward(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    tmp = tmp_path_factory.mktemp("reward")
    args = ["--workers", "1", "--timeout-s", "3"]
    async with harness("pipelinerl.reward", tmp, *args, memory_limit_gib=4, serves=scores_a_valid_item) as h:
        yield h


async def scores_a_valid_item(channel: grpc.aio.Channel) -> None:
    response = await reward_pb2_grpc.RewardServiceStub(channel).Score(
        pb.ScoreRequest(items=[item("valid")]), metadata=AUTH, timeout=20
    )
    [result] = response.results
    assert result.status.code == code_value(OK) and result.reward == 1.0, result


CALL_CASES = [
    ("empty batch", pb.ScoreRequest(), INVALID),
    ("4097 items", pb.ScoreRequest(items=[item(f"s{i}", verifier="") for i in range(4097)]), INVALID),
    ("duplicate sample ids", pb.ScoreRequest(items=[item("a"), item("b"), item("a")]), INVALID),
    ("4096 items, all invalid", pb.ScoreRequest(items=[item(f"s{i}", verifier="") for i in range(4096)]), OK),
]


@pytest.mark.parametrize(("name", "request_", "code"), CALL_CASES, ids=[c[0] for c in CALL_CASES])
async def test_malformed_batch(
    reward: Harness, name: str, request_: pb.ScoreRequest, code: grpc.StatusCode
) -> None:
    stub = reward_pb2_grpc.RewardServiceStub(reward.channel)
    await reward.expect(code_of(stub.Score(request_, metadata=AUTH, timeout=30)), code)


ITEM_CASES = [
    ("empty sample id", item(sample_id=""), {INVALID}),
    ("unknown verifier", item(verifier="nope"), {INVALID}),
    ("empty verifier", item(verifier=""), {INVALID}),
    ("verifier name with NUL", item(verifier="exact\x00"), {INVALID}),
    ("python verifier not configured", item(verifier="python"), {INVALID}),
    ("format verifier needs no answer", item(verifier="format", answer=""), {OK}),
    ("math without answer", item(verifier="math", answer=""), {INVALID}),
    ("exact with a blank answer", item(answer=" \n\t"), {INVALID}),
    ("numeric answer not a number", item(verifier="numeric", answer="four"), {INVALID}),
    ("digits answer not digits", item(verifier="digits", answer="4a"), {INVALID}),
    ("math gold answer unparseable", item(verifier="math", answer="\\boxed{}"), {INVALID}),
    ("completion over the limit", item(completion="4" * (MAX_COMPLETION_CHARS + 1)), {INVALID}),
    ("completion at the limit", item(completion="4" * MAX_COMPLETION_CHARS), {OK}),
    ("numeric gold nan", item(verifier="numeric", answer="nan", completion="nan"), {OK}),
    ("numeric gold inf", item(verifier="numeric", answer="inf", completion="1e999"), {OK}),
    ("numeric huge number", item(verifier="numeric", answer="1" + "0" * 400, completion="9" * 5000), {OK}),
    ("NUL and control bytes", item(completion="\x00\x01\x1b[2J4\x00"), {OK}),
    (
        "nested braces for math",
        item(verifier="math", answer="1", completion="\\boxed{" * 3000),
        {OK, DEADLINE},
    ),
    (
        "power tower for math",
        item(verifier="math", answer="1", completion="\\boxed{9^{9^{9^{9^{9}}}}}"),
        {OK, DEADLINE},
    ),
]


@pytest.mark.parametrize(("name", "item_", "codes"), ITEM_CASES, ids=[c[0] for c in ITEM_CASES])
async def test_bad_item_fails_alone(
    reward: Harness, name: str, item_: pb.ScoreItem, codes: set[grpc.StatusCode]
) -> None:
    stub = reward_pb2_grpc.RewardServiceStub(reward.channel)
    request = pb.ScoreRequest(items=[item_, item("neighbour")])
    response = await stub.Score(request, metadata=AUTH, timeout=30)
    await reward.still_serving()
    bad, neighbour = response.results
    assert bad.status.code in {code_value(c) for c in codes}, bad.status
    assert neighbour.status.code == code_value(OK) and neighbour.reward == 1.0


RAW_CASES = [
    ("Score", UNDECODABLE, INVALID),
    ("Score", TRUNCATED, INVALID),
    ("Score", b"\x0a\x04" + BAD_UTF8, INVALID),  # items[0].sample_id is not UTF-8
    ("Score", b"\x08\x01", INVALID),  # `items` sent as a varint: unknown to the parser, so no items
    ("ListVerifiers", UNDECODABLE, INVALID),
    ("GetStatus", UNDECODABLE, INVALID),
    ("ListVerifiers", b"\xf8\x06\x01", OK),  # an unknown field 111 is ignored
    ("Nope", b"", UNIMPLEMENTED),
]


@pytest.mark.parametrize(
    ("method", "data", "code"), RAW_CASES, ids=[f"{m}-{d.hex()}" for m, d, _ in RAW_CASES]
)
async def test_raw_bytes(reward: Harness, method: str, data: bytes, code: grpc.StatusCode) -> None:
    await reward.expect(raw_unary(reward.channel, SERVICE + method, data), code)


@pytest.mark.parametrize("method", ["Score", "ListVerifiers", "GetStatus"])
@pytest.mark.parametrize("auth", sorted(AUTH_CASES))
async def test_bad_token(reward: Harness, method: str, auth: str) -> None:
    data = pb.ScoreRequest(items=[item()]).SerializeToString() if method == "Score" else b""
    await reward.expect(raw_unary(reward.channel, SERVICE + method, data, AUTH_CASES[auth]), UNAUTHENTICATED)


async def test_oversize_message_is_resource_exhausted(reward: Harness) -> None:
    request = pb.ScoreRequest(items=[item(completion="4" * OVERSIZE_BYTES)])
    stub = reward_pb2_grpc.RewardServiceStub(reward.channel)
    await reward.expect(code_of(stub.Score(request, metadata=AUTH, timeout=30)), EXHAUSTED)


async def test_deadline_shorter_than_the_batch(reward: Harness) -> None:
    stub = reward_pb2_grpc.RewardServiceStub(reward.channel)
    request = pb.ScoreRequest(items=[item(f"d{i}") for i in range(2000)])
    await reward.expect(code_of(stub.Score(request, metadata=AUTH, timeout=0.05)), DEADLINE)


async def test_thousands_of_abandoned_calls_leave_rss_bounded(reward: Harness) -> None:
    async def abandon(count: int) -> None:
        async with reward.service.channel() as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            for start in range(0, count, 250):
                calls = [
                    stub.Score(pb.ScoreRequest(items=[item(f"a{start + i}")]), metadata=AUTH, timeout=30)
                    for i in range(250)
                ]
                await asyncio.sleep(0.01)  # let them reach the server
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)

    await abandon(250)  # warm up allocators and gRPC's pools
    before = reward.service.rss_mb()
    started = time.monotonic()
    await abandon(2000)
    elapsed_s, growth_mb = time.monotonic() - started, reward.service.rss_mb() - before
    log.info(
        "abandoned calls",
        elapsed_s=round(elapsed_s, 1),
        rss_before_mb=round(before),
        rss_growth_mb=round(growth_mb, 1),
    )
    await reward.still_serving_after_a_flood()
    assert elapsed_s < 60 and growth_mb < 50, (elapsed_s, growth_mb)
    status = await reward_pb2_grpc.RewardServiceStub(reward.channel).GetStatus(
        pb.GetStatusRequest(), metadata=AUTH, timeout=20
    )
    assert status.workers == 1


@pytest.mark.parametrize("method", ["Score", "ListVerifiers", "GetStatus"])
async def test_request_cut_by_end_of_stream_is_invalid(reward: Harness, method: str) -> None:
    await reward.expect(code_of_cut_call(reward.service.port, SERVICE + method), INVALID)
