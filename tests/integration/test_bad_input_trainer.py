"""Malformed and hostile requests to a real trainer (a subprocess training the tiny preset, with a
bearer token): a bad sample is REJECTED naming its field, a bad call gets its documented status,
and the trainer still trains a valid group after each."""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2

from pipelinerl.common.log import get_logger
from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.common.v1 import common_pb2
from pipelinerl.trainer.v1 import trainer_pb2 as pb
from pipelinerl.trainer.v1 import trainer_pb2_grpc
from tests.integration.hostile import (
    AUTH,
    AUTH_CASES,
    DEADLINE,
    EXHAUSTED,
    INVALID,
    OK,
    OVERSIZE_BYTES,
    PRECONDITION,
    TRUNCATED,
    UNAUTHENTICATED,
    UNDECODABLE,
    Harness,
    abandon_calls,
    code_of_cut_call,
    code_value,
    half_sent_message,
    harness,
    raw_stream,
    raw_unary,
    stream_code,
)

log = get_logger(__name__)
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SERVICE = "/pipelinerl.trainer.v1.TrainerService/"
RUN_ID = "bad-input"
VOCAB, CONTEXT = len(build_tokenizer()), 1024  # the tiny preset's
INT32_MAX = 2**31 - 1
NAN, INF = math.nan, math.inf
_ids = itertools.count()


def sample(
    sample_id: str = "bad", reward: float = 1.0, version: int = 0, **fields: object
) -> common_pb2.Sample:
    """A sample of a group of one; `completion` fields go in as `token_ids=`, `logprobs=`, `versions=`."""
    completion = {"token_ids": [8, 9], "logprobs": [-0.5, -0.5], "versions": [version, version]}
    completion.update({k: fields.pop(k) for k in list(fields) if k in completion})  # type: ignore[misc]
    values: dict[str, object] = {"group_id": f"g-{sample_id}", "prompt_token_ids": [5, 6, 7], "group_size": 1}
    return common_pb2.Sample(
        sample_id=sample_id,
        reward=reward,
        completion=common_pb2.TokenSequence(**completion),
        **{**values, **fields},
    )  # type: ignore[arg-type]


MODEL_RUN, CONTEXT_RUN = common_pb2.SEGMENT_KIND_MODEL, common_pb2.SEGMENT_KIND_CONTEXT
UNSPECIFIED_RUN = common_pb2.SEGMENT_KIND_UNSPECIFIED
TWO_TURNS = ((MODEL_RUN, 1), (CONTEXT_RUN, 1), (MODEL_RUN, 1))


def episode(
    *runs: tuple[int, int], sample_id: str = "bad", version: int = 0, **fields: object
) -> common_pb2.Sample:
    """A multi-turn sample over completion tokens [8, 9, 10] in `runs` of (segment kind, tokens),
    with a logprob and a version per model token unless `fields` say otherwise."""
    model_tokens = sum(n for kind, n in runs if kind == MODEL_RUN)
    values = {
        "token_ids": [8, 9, 10],
        "logprobs": [-0.5] * model_tokens,
        "versions": [version] * model_tokens,
    }
    segments = [common_pb2.Segment(kind=kind, num_tokens=n) for kind, n in runs]  # type: ignore[arg-type]
    return sample(sample_id, version=version, segments=segments, **{**values, **fields})


def stub(channel: grpc.aio.Channel) -> trainer_pb2_grpc.TrainerServiceStub:
    return trainer_pb2_grpc.TrainerServiceStub(channel)


async def submit(channel: grpc.aio.Channel, *samples: common_pb2.Sample) -> dict[str, pb.SampleAck]:
    """The final ack of each sample, sent in one flushed message on a stream of its own."""
    call = stub(channel).SubmitSamples(metadata=AUTH, timeout=60)
    await call.write(pb.SubmitSamplesRequest(samples=samples, flush=True))
    await call.done_writing()
    final: dict[str, pb.SampleAck] = {}
    async with asyncio.timeout(30):
        async for response in call:
            final.update({a.sample_id: a for a in response.acks if a.disposition != pb.DISPOSITION_ACCEPTED})
    return final


async def version(channel: grpc.aio.Channel) -> int:
    return (await stub(channel).GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=20)).version.version


async def trains_a_valid_group(channel: grpc.aio.Channel) -> None:
    v, n = await version(channel), next(_ids)
    group = [sample(f"valid{n}-{i}", float(i), v, group_id=f"valid{n}", group_size=2) for i in range(2)]
    acks = await submit(channel, *group)
    assert [a.disposition for a in acks.values()] == [pb.DISPOSITION_TRAINED] * 2, acks
    assert await version(channel) == v + 1


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def trainer(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    args = ["--model", "tiny", "--samples-per-step", "2", "--broadcast-backend", "none", "--max-lag", "1000"]
    args += ["--threads", "1", "--run-id", RUN_ID]
    tmp = tmp_path_factory.mktemp("trainer")
    async with harness(
        "pipelinerl.trainer", tmp, *args, memory_limit_gib=6, serves=trains_a_valid_group
    ) as h:
        yield h


SAMPLE_CASES = [
    ("empty sample id", sample(""), "sample_id"),
    ("empty prompt", sample(prompt_token_ids=[]), "prompt_token_ids"),
    ("empty completion", sample(token_ids=[], logprobs=[], versions=[]), "completion.token_ids"),
    ("reward NaN", sample(reward=NAN), "reward"),
    ("reward inf", sample(reward=INF), "reward"),
    ("reward -inf", sample(reward=-INF), "reward"),
    ("fewer logprobs than tokens", sample(logprobs=[-0.5]), "completion.logprobs"),
    ("more versions than tokens", sample(versions=[0, 0, 0]), "completion.versions"),
    ("positive logprob", sample(logprobs=[-0.5, 0.5]), "completion.logprobs"),
    ("NaN logprob", sample(logprobs=[NAN, -0.5]), "completion.logprobs"),
    ("-inf logprob", sample(logprobs=[-INF, -0.5]), "completion.logprobs"),
    ("negative version", sample(versions=[0, -1]), "completion.versions"),
    ("version from the future", sample(versions=[0, 10**9]), "completion.versions"),
    ("completion token negative", sample(token_ids=[8, -1]), "completion.token_ids"),
    ("completion token = vocab size", sample(token_ids=[8, VOCAB]), "completion.token_ids"),
    ("completion token int32 max", sample(token_ids=[INT32_MAX, 8]), "completion.token_ids"),
    ("prompt token negative", sample(prompt_token_ids=[5, -3]), "prompt_token_ids"),
    ("prompt token = vocab size", sample(prompt_token_ids=[VOCAB]), "prompt_token_ids"),
    ("prompt token int32 max", sample(prompt_token_ids=[INT32_MAX]), "prompt_token_ids"),
    ("longer than the context", sample(prompt_token_ids=[5] * (CONTEXT - 1)), ""),
    # Segmented (multi-turn) samples: logprobs and versions for model tokens only.
    ("segments short of the completion", episode((MODEL_RUN, 1), (CONTEXT_RUN, 1)), "segments"),
    ("segment past the completion", episode((MODEL_RUN, 1), (CONTEXT_RUN, 3)), "segments[1].num_tokens"),
    ("segment of no tokens", episode((MODEL_RUN, 1), (CONTEXT_RUN, 0), (CONTEXT_RUN, 2)), "segments[1]."),
    ("segment of -1 tokens", episode((MODEL_RUN, 2), (CONTEXT_RUN, -1), (MODEL_RUN, 2)), "segments[1]."),
    ("segment kind unspecified", episode((MODEL_RUN, 1), (UNSPECIFIED_RUN, 2)), "segments[1].kind"),
    ("segment kind unknown", episode((MODEL_RUN, 1), (7, 2)), "segments[1].kind"),
    ("no model segment", episode((CONTEXT_RUN, 3)), "segments"),
    ("model segment without logprobs", episode(*TWO_TURNS, logprobs=[-0.5]), "completion.logprobs"),
    ("context segment with versions", episode(*TWO_TURNS, versions=[0] * 3), "completion.versions"),
    ("context segment with logprobs", episode(*TWO_TURNS, logprobs=[-0.5] * 3), "completion.logprobs"),
    ("context token = vocab size", episode(*TWO_TURNS, token_ids=[8, 9, VOCAB]), "completion.token_ids"),
    (
        "segmented, too long",
        episode((MODEL_RUN, 1), (CONTEXT_RUN, CONTEXT), token_ids=[8] * (CONTEXT + 1)),
        "",
    ),
]


@pytest.mark.parametrize(("name", "sample_", "field"), SAMPLE_CASES, ids=[c[0] for c in SAMPLE_CASES])
async def test_bad_sample_is_rejected_naming_its_field(
    trainer: Harness, name: str, sample_: common_pb2.Sample, field: str
) -> None:
    try:
        acks = await submit(trainer.channel, sample_)
    finally:
        await trainer.still_serving()
    ack = acks[sample_.sample_id]
    assert ack.disposition == pb.DISPOSITION_REJECTED, ack
    assert ack.error.code == code_value(INVALID), ack
    [detail] = ack.error.details
    bad_request = error_details_pb2.BadRequest()
    assert detail.Unpack(bad_request)
    # Any field of the sample for a sample too long; `[i]` may follow a repeated field's name.
    assert bad_request.field_violations[0].field.startswith(f"samples[0].{field}".rstrip(".")), ack


async def test_a_multi_turn_group_trains(trainer: Harness) -> None:
    v = await version(trainer.channel)
    group = [
        episode(*TWO_TURNS, sample_id=f"turns-{i}", version=v, reward=i, group_id="turns", group_size=2)
        for i in range(2)
    ]
    try:
        acks = await submit(trainer.channel, *group)
        assert [a.disposition for a in acks.values()] == [pb.DISPOSITION_TRAINED] * 2, acks
        assert await version(trainer.channel) == v + 1
    finally:
        await trainer.still_serving()


async def test_a_rejected_sample_does_not_hold_back_its_group(trainer: Harness) -> None:
    v = await version(trainer.channel)
    good = sample("partner", 1.0, v, group_id="mixed", group_size=2)
    bad = sample("bad-token", 0.0, v, group_id="mixed", group_size=2, token_ids=[8, VOCAB])
    try:
        acks = await submit(trainer.channel, good, bad)
    finally:
        await trainer.still_serving()
    assert acks["bad-token"].disposition == pb.DISPOSITION_REJECTED
    assert acks["partner"].disposition in (pb.DISPOSITION_TRAINED, pb.DISPOSITION_DROPPED)


async def test_too_many_samples_in_one_message(trainer: Harness) -> None:
    request = pb.SubmitSamplesRequest(samples=[sample(f"many{i}") for i in range(4097)])
    await trainer.expect(submit_code(trainer.channel, request), INVALID)


async def test_oversize_message_is_resource_exhausted(trainer: Harness) -> None:
    request = pb.SubmitSamplesRequest(samples=[sample("huge", prompt_token_ids=[5] * OVERSIZE_BYTES)])
    await trainer.expect(submit_code(trainer.channel, request), EXHAUSTED)


async def submit_code(channel: grpc.aio.Channel, request: pb.SubmitSamplesRequest) -> grpc.StatusCode:
    """The status of a SubmitSamples stream that sends `request`, then half-closes."""
    call = stub(channel).SubmitSamples(metadata=AUTH, timeout=30)
    try:
        await call.write(request)
        await call.done_writing()
    except grpc.aio.AioRpcError as err:
        return err.code()
    return await stream_code(call)


RAW_CASES = [
    ("SubmitSamples", UNDECODABLE, INVALID),
    ("SubmitSamples", TRUNCATED, INVALID),
    ("WatchWeights", UNDECODABLE, INVALID),
    ("FetchWeights", UNDECODABLE, INVALID),
    ("FetchWeights", TRUNCATED, INVALID),
    ("GetStatus", UNDECODABLE, INVALID),
]


@pytest.mark.parametrize(
    ("method", "data", "code"), RAW_CASES, ids=[f"{m}-{d.hex()}" for m, d, _ in RAW_CASES]
)
async def test_undecodable_bytes(trainer: Harness, method: str, data: bytes, code: grpc.StatusCode) -> None:
    if method == "GetStatus":
        call = raw_unary(trainer.channel, SERVICE + method, data)
    else:
        call = raw_stream(
            trainer.channel, SERVICE + method, data, streaming_request=method == "SubmitSamples"
        )
    await trainer.expect(call, code)


def fetch(version: int, run_id: str = RUN_ID, buckets: tuple[int, ...] = ()) -> pb.FetchWeightsRequest:
    return pb.FetchWeightsRequest(
        version=common_pb2.WeightVersion(version=version, run_id=run_id), buckets=buckets
    )


FETCH_CASES = [
    ("negative version", fetch(-1), INVALID),
    ("version never published", fetch(10**9), PRECONDITION),
    ("another run's version", fetch(0, run_id="someone-else"), PRECONDITION),
    ("bucket out of range", fetch(0, buckets=(99,)), INVALID),
    ("negative bucket", fetch(0, buckets=(-1,)), INVALID),
    ("the initial version, valid", fetch(0), OK),
    ("no run id, valid", fetch(0, run_id=""), OK),
]


@pytest.mark.parametrize(("name", "request_", "code"), FETCH_CASES, ids=[c[0] for c in FETCH_CASES])
async def test_fetch_weights(
    trainer: Harness, name: str, request_: pb.FetchWeightsRequest, code: grpc.StatusCode
) -> None:
    if request_.version.version == 0:  # the current version: the initial one may be released by now
        request_.version.version = await version(trainer.channel)
    call = stub(trainer.channel).FetchWeights(request_, metadata=AUTH, timeout=30)
    await trainer.expect(stream_code(call), code)


async def test_watch_weights_without_receiver_id(trainer: Harness) -> None:
    call = stub(trainer.channel).WatchWeights(
        pb.WatchWeightsRequest(receiver_id=""), metadata=AUTH, timeout=20
    )
    await trainer.expect(stream_code(call), INVALID)


async def test_deadline_ends_a_watch(trainer: Harness) -> None:
    call = stub(trainer.channel).WatchWeights(
        pb.WatchWeightsRequest(receiver_id="w"), metadata=AUTH, timeout=0.5
    )
    await trainer.expect(stream_code(call), DEADLINE)


REQUESTS = {
    "SubmitSamples": b"",
    "WatchWeights": pb.WatchWeightsRequest(receiver_id="w").SerializeToString(),
    "FetchWeights": fetch(0).SerializeToString(),
    "GetStatus": b"",
}


@pytest.mark.parametrize("method", sorted(REQUESTS))
@pytest.mark.parametrize("auth", sorted(AUTH_CASES))
async def test_bad_token(trainer: Harness, method: str, auth: str) -> None:
    metadata = AUTH_CASES[auth]
    if method == "GetStatus":
        call = raw_unary(trainer.channel, SERVICE + method, b"", metadata)
    elif method == "SubmitSamples":
        # No request is written: the token is checked as the call starts, and grpc's client marks
        # a call INTERNAL when its write races the server's UNAUTHENTICATED.
        stream = trainer.channel.stream_stream(SERVICE + method, pb.SubmitSamplesRequest.SerializeToString)
        call = stream_code(stream(iter([]), metadata=metadata, timeout=20))
    else:
        call = stream_code(
            trainer.channel.unary_stream(SERVICE + method)(REQUESTS[method], metadata=metadata, timeout=20)
        )
    await trainer.expect(call, UNAUTHENTICATED)


@pytest.mark.parametrize("rst_stream", [True, False], ids=["cancelled", "dropped"])
@pytest.mark.parametrize("method", ["SubmitSamples", "FetchWeights"])
async def test_stream_cut_mid_message(trainer: Harness, method: str, rst_stream: bool) -> None:
    half_sent_message(trainer.service.port, SERVICE + method, rst_stream)
    await trainer.still_serving()


@pytest.mark.parametrize("method", ["WatchWeights", "FetchWeights", "GetStatus", "ReleaseWeights"])
async def test_request_cut_by_end_of_stream_is_invalid(trainer: Harness, method: str) -> None:
    await trainer.expect(code_of_cut_call(trainer.service.port, SERVICE + method), INVALID)


async def test_stream_cut_by_its_end_ends_at_once(trainer: Harness) -> None:
    # gRPC's transport drops a message cut short by the end of its stream and reports just the end,
    # so the call ends as a stream closed after its last whole message: OK, no error to give.
    await trainer.expect(code_of_cut_call(trainer.service.port, SERVICE + "SubmitSamples"), OK)


async def test_thousands_of_abandoned_streams_leave_rss_bounded(trainer: Harness) -> None:
    receivers = itertools.count()

    def watch(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamCall:
        request = pb.WatchWeightsRequest(receiver_id=f"abandoned{next(receivers)}", current_version=-1)
        return stub(channel).WatchWeights(request, metadata=AUTH, timeout=60)

    def samples(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
        return stub(channel).SubmitSamples(metadata=AUTH, timeout=60)

    await abandon_calls(trainer.service, watch, 250)  # warm up allocators and gRPC's pools
    before = trainer.service.rss_mb()
    started = time.monotonic()
    await abandon_calls(trainer.service, watch, 1000)
    await abandon_calls(trainer.service, samples, 1000, first_response=False)
    elapsed_s, growth_mb = time.monotonic() - started, trainer.service.rss_mb() - before
    log.info(
        "abandoned calls",
        elapsed_s=round(elapsed_s, 1),
        rss_before_mb=round(before),
        rss_growth_mb=round(growth_mb, 1),
    )
    await trainer.still_serving()
    for _ in range(100):
        status = await stub(trainer.channel).GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=20)
        if status.watchers == 0:
            break
        await asyncio.sleep(0.05)
    assert status.watchers == 0
    assert elapsed_s < 90 and growth_mb < 50, (elapsed_s, growth_mb)
