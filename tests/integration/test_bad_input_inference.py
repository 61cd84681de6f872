"""Malformed and hostile requests to a real inference server (a subprocess serving the tiny preset,
with a bearer token): each gets its documented status, a bad request fails alone while its stream
goes on, and the server still completes a valid request after it."""

from __future__ import annotations

import asyncio
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
from pipelinerl.inference.v1 import inference_pb2 as pb
from pipelinerl.inference.v1 import inference_pb2_grpc
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
    Harness,
    abandon_calls,
    code_of,
    code_of_cut_call,
    half_sent_message,
    harness,
    raw_unary,
)

log = get_logger(__name__)
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SERVICE = "/pipelinerl.inference.v1.InferenceService/"
VOCAB = len(build_tokenizer())  # the tiny preset's
MAX_RUNNING, QUEUE_AHEAD, MAX_NEW_TOKENS, CONTEXT = 4, 2, 16, 128
WINDOW = MAX_RUNNING + QUEUE_AHEAD  # requests a stream may have in flight
INT32_MAX = 2**31 - 1
NAN, INF = math.nan, math.inf
CODES = {code.value[0]: code for code in grpc.StatusCode}


def submission(request_id: str = "bad", **fields: object) -> pb.GenerateRequest:
    fields.setdefault("sampling", sampling())
    if "prompt_text" not in fields:
        fields.setdefault("prompt_token_ids", [5, 6, 7])
    return pb.GenerateRequest(submit=pb.Submission(request_id=request_id, **fields))  # type: ignore[arg-type]


def batch(*requests: pb.GenerateRequest) -> pb.GenerateRequest:
    """The submissions of these `submission()` messages in one SubmissionBatch."""
    return pb.GenerateRequest(submit_batch=pb.SubmissionBatch(submissions=[r.submit for r in requests]))


def sampling(**fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_new_tokens": 4, **fields})  # type: ignore[arg-type]


async def open_generate(channel: grpc.aio.Channel, metadata: object = AUTH) -> grpc.aio.StreamStreamCall:
    call = inference_pb2_grpc.InferenceServiceStub(channel).Generate(metadata=metadata, timeout=60)
    first = await call.read()
    assert first.WhichOneof("event") == "capacity", first
    return call


async def outcome(
    call: grpc.aio.StreamStreamCall, request_id: str
) -> tuple[grpc.StatusCode, pb.GenerateResponse]:
    """OK and the completion of `request_id`, or the code of its RequestError."""
    async with asyncio.timeout(30):
        while (response := await call.read()) is not grpc.aio.EOF:
            event = response.WhichOneof("event")
            if event == "completion" and response.completion.request_id == request_id:
                return OK, response
            if event == "error" and response.error.request_id == request_id:
                return CODES[response.error.status.code], response
    raise AssertionError(f"the stream ended without an answer for {request_id!r}")


async def completes_a_valid_request(channel: grpc.aio.Channel) -> None:
    call = await open_generate(channel)
    try:
        await call.write(submission("valid"))
        code, response = await outcome(call, "valid")
        assert code == OK and len(response.completion.completion.token_ids) == 4, response
    finally:
        call.cancel()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def inference(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    args = ["--model", "tiny", "--max-running", str(MAX_RUNNING), "--queue-ahead", str(QUEUE_AHEAD)]
    args += ["--max-new-tokens", str(MAX_NEW_TOKENS)]
    args += ["--max-model-len", str(CONTEXT), "--ignore-eos", "--threads", "1"]
    tmp = tmp_path_factory.mktemp("inference")
    async with harness(
        "pipelinerl.inference", tmp, *args, memory_limit_gib=6, serves=completes_a_valid_request
    ) as h:
        yield h


SUBMIT_CASES = [
    ("empty request id", submission(""), INVALID),
    ("request id of 129 bytes", submission("r" * 129), INVALID),
    ("request id of 128 bytes", submission("r" * 128), OK),
    ("no prompt", submission(prompt_token_ids=[]), INVALID),
    ("both prompt ids and text", submission(prompt_token_ids=[5], prompt_text="5"), INVALID),
    ("token id = vocab size", submission(prompt_token_ids=[5, VOCAB]), INVALID),
    ("token id int32 max", submission(prompt_token_ids=[INT32_MAX]), INVALID),
    ("token id negative", submission(prompt_token_ids=[5, -1]), INVALID),
    ("prompt fills the context", submission(prompt_token_ids=[5] * CONTEXT), INVALID),
    (
        "prompt + max new tokens over the context",
        submission(prompt_token_ids=[5] * (CONTEXT - 8), sampling=sampling(max_new_tokens=16)),
        INVALID,
    ),
    (
        "prompt + max new tokens fill the context",
        submission(prompt_token_ids=[5] * (CONTEXT - 4), sampling=sampling(max_new_tokens=4)),
        OK,
    ),
    ("request id of 130 bytes in 65 characters", submission("é" * 65), INVALID),
    ("prompt text of 100k characters", submission(prompt_text="7" * 100_000), INVALID),
    ("prompt text outside the vocabulary", submission(prompt_text="ü€☃"), OK),
    ("prompt text with NUL", submission(prompt_text="1\x002"), OK),
    ("max new tokens 0", submission(sampling=sampling(max_new_tokens=0)), INVALID),
    ("max new tokens negative", submission(sampling=sampling(max_new_tokens=-1)), INVALID),
    (
        "max new tokens over the limit",
        submission(sampling=sampling(max_new_tokens=MAX_NEW_TOKENS + 1)),
        INVALID,
    ),
    ("max new tokens int32 max", submission(sampling=sampling(max_new_tokens=INT32_MAX)), INVALID),
    ("temperature NaN", submission(sampling=sampling(temperature=NAN)), INVALID),
    ("temperature inf", submission(sampling=sampling(temperature=INF)), INVALID),
    ("temperature -inf", submission(sampling=sampling(temperature=-INF)), INVALID),
    ("temperature negative", submission(sampling=sampling(temperature=-1.0)), INVALID),
    ("temperature over 100", submission(sampling=sampling(temperature=101.0)), INVALID),
    ("temperature 1e-45", submission(sampling=sampling(temperature=1e-45)), OK),
    ("temperature 1e-30", submission(sampling=sampling(temperature=1e-30)), OK),
    ("temperature 0 (greedy)", submission(sampling=sampling(temperature=0.0)), OK),
    ("temperature 100", submission(sampling=sampling(temperature=100.0)), OK),
    ("top p 0", submission(sampling=sampling(top_p=0.0)), INVALID),
    ("top p NaN", submission(sampling=sampling(top_p=NAN)), INVALID),
    ("top p negative", submission(sampling=sampling(top_p=-1.0)), INVALID),
    ("top p just over 1", submission(sampling=sampling(top_p=1.0000002)), INVALID),
    ("top p 1e-45", submission(sampling=sampling(top_p=1e-45)), OK),
    ("top k negative", submission(sampling=sampling(top_k=-1)), INVALID),
    ("top k int32 max", submission(sampling=sampling(top_k=INT32_MAX)), OK),
    ("stop token negative", submission(sampling=sampling(stop_token_ids=[-1])), INVALID),
    ("stop token = vocab size", submission(sampling=sampling(stop_token_ids=[VOCAB])), INVALID),
    ("stop token int32 max", submission(sampling=sampling(stop_token_ids=[INT32_MAX])), INVALID),
    ("17 stop strings", submission(sampling=sampling(stop=[str(i) for i in range(17)])), INVALID),
    ("empty stop string", submission(sampling=sampling(stop=[""])), INVALID),
    ("stop string of 257 bytes", submission(sampling=sampling(stop=["x" * 257])), INVALID),
    ("stop string outside the vocabulary", submission(sampling=sampling(stop=["€"])), INVALID),
    ("largest seed", submission(sampling=sampling(seed=2**64 - 1)), OK),
    ("trace ids of every key", submission(trace={"run": "r", "group_id": "g", "sample_id": "s"}), OK),
    ("trace id under an unknown key", submission(trace={"service": "spoofed"}), INVALID),
    ("trace id of 129 bytes", submission(trace={"run": "r" * 129}), INVALID),
    (
        "every extreme at once, valid",
        submission(sampling=sampling(temperature=1e-45, top_p=1e-45, top_k=INT32_MAX, seed=0)),
        OK,
    ),
]


@pytest.mark.parametrize(("name", "request_", "code"), SUBMIT_CASES, ids=[c[0] for c in SUBMIT_CASES])
async def test_bad_request_fails_alone(
    inference: Harness, name: str, request_: pb.GenerateRequest, code: grpc.StatusCode
) -> None:
    async def submit() -> grpc.StatusCode:
        call = await open_generate(inference.channel)
        try:
            await call.write(request_)
            result, _ = await outcome(call, request_.submit.request_id)
            await call.write(submission("after"))  # the stream goes on
            assert (await outcome(call, "after"))[0] == OK
            return result
        finally:
            call.cancel()

    await inference.expect(submit(), code)


async def test_duplicate_in_flight_id_and_over_capacity(inference: Harness) -> None:
    async def flood() -> grpc.StatusCode:
        call = await open_generate(inference.channel)
        try:
            long = sampling(max_new_tokens=MAX_NEW_TOKENS)
            await call.write(submission("same", sampling=long))
            await call.write(submission("same", sampling=long))
            assert (await outcome(call, "same"))[0] == INVALID  # the second one; the first runs on
            for i in range(WINDOW - 1):
                await call.write(submission(f"fill{i}", sampling=long))
            await call.write(submission("extra"))
            return (await outcome(call, "extra"))[0]
        finally:
            call.cancel()

    await inference.expect(flood(), EXHAUSTED)


async def test_a_batch_answers_each_submission_as_if_it_came_alone(inference: Harness) -> None:
    """In one SubmissionBatch, a bad submission and one over capacity each get their own error, naming
    the bad field by its index in the batch; the good ones complete in CompletionBatch messages; an
    empty batch does nothing; a single submit on the same stream is still answered alone."""

    async def submit() -> grpc.StatusCode:
        call = await open_generate(inference.channel)
        try:
            await call.write(pb.GenerateRequest(submit_batch=pb.SubmissionBatch()))
            good = [submission(f"good{i}") for i in range(WINDOW)]
            bad = submission("bad", sampling=sampling(temperature=-1.0))
            await call.write(batch(good[0], bad, *good[1:], submission("over")))
            errors: dict[str, grpc.StatusCode] = {}
            completed: list[str] = []
            async with asyncio.timeout(30):
                while len(errors) + len(completed) < WINDOW + 2:
                    response = await call.read()
                    event = response.WhichOneof("event")
                    if event == "error":
                        errors[response.error.request_id] = CODES[response.error.status.code]
                        if response.error.request_id == "bad":
                            detail = error_details_pb2.BadRequest()
                            response.error.status.details[0].Unpack(detail)
                            fields = [v.field for v in detail.field_violations]
                            assert fields == ["submit_batch.submissions[1].sampling.temperature"], fields
                    else:
                        assert event == "completions", response
                        completed += [c.request_id for c in response.completions.completions]
                        assert all(len(c.completion.token_ids) == 4 for c in response.completions.completions)
            assert sorted(completed) == [f"good{i}" for i in range(WINDOW)]
            assert errors == {"bad": INVALID, "over": EXHAUSTED}
            await call.write(submission("alone"))
            code, response = await outcome(call, "alone")  # a `completion` event, not a batch
            return code
        finally:
            call.cancel()

    await inference.expect(submit(), OK)


async def test_cancel_of_an_unknown_id_is_ignored_and_a_running_one_aborts(inference: Harness) -> None:
    async def cancel() -> grpc.StatusCode:
        call = await open_generate(inference.channel)
        try:
            await call.write(pb.GenerateRequest(cancel=pb.Cancellation(request_id="never-sent")))
            await call.write(submission("long", sampling=sampling(max_new_tokens=MAX_NEW_TOKENS)))
            await call.write(pb.GenerateRequest(cancel=pb.Cancellation(request_id="long")))
            code, response = await outcome(call, "long")
            assert response.completion.finish_reason in (
                common_pb2.FINISH_REASON_ABORT,
                common_pb2.FINISH_REASON_LENGTH,
            )
            return code
        finally:
            call.cancel()

    await inference.expect(cancel(), OK)


RAW_CASES = [
    ("undecodable", [UNDECODABLE]),
    ("truncated", [TRUNCATED]),
    ("submission not UTF-8", [BAD_UTF8]),
    ("garbage after a valid request", [submission("ok").SerializeToString(), UNDECODABLE]),
]


@pytest.mark.parametrize(("name", "messages"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
async def test_undecodable_bytes_end_the_stream(inference: Harness, name: str, messages: list[bytes]) -> None:
    async def send() -> grpc.StatusCode:
        call = inference.channel.stream_stream(SERVICE + "Generate")(metadata=AUTH, timeout=30)
        for message in messages:
            await call.write(message)
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
        return await call.code()

    await inference.expect(send(), INVALID)


async def test_undecodable_status_request(inference: Harness) -> None:
    await inference.expect(raw_unary(inference.channel, SERVICE + "GetStatus", UNDECODABLE), INVALID)


@pytest.mark.parametrize("method", ["Generate", "GetStatus"])
@pytest.mark.parametrize("auth", sorted(AUTH_CASES))
async def test_bad_token(inference: Harness, method: str, auth: str) -> None:
    async def call() -> grpc.StatusCode:
        if method == "GetStatus":
            return await raw_unary(inference.channel, SERVICE + method, b"", AUTH_CASES[auth])
        try:
            await open_generate(inference.channel, AUTH_CASES[auth])
        except grpc.aio.AioRpcError as err:
            return err.code()
        return OK

    await inference.expect(call(), UNAUTHENTICATED)


async def test_oversize_message_is_resource_exhausted(inference: Harness) -> None:
    async def send() -> grpc.StatusCode:
        call = await open_generate(inference.channel)
        await call.write(submission(prompt_text="7" * OVERSIZE_BYTES))
        return await code_of(call.read())

    await inference.expect(send(), EXHAUSTED)


async def test_deadline_ends_an_idle_stream(inference: Harness) -> None:
    async def idle() -> grpc.StatusCode:
        call = inference_pb2_grpc.InferenceServiceStub(inference.channel).Generate(metadata=AUTH, timeout=0.5)
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as err:
            return err.code()
        return OK

    await inference.expect(idle(), DEADLINE)


@pytest.mark.parametrize("rst_stream", [True, False], ids=["cancelled", "dropped"])
async def test_stream_cut_mid_message(inference: Harness, rst_stream: bool) -> None:
    half_sent_message(inference.service.port, SERVICE + "Generate", rst_stream)
    await inference.still_serving()


@pytest.mark.parametrize("method", ["GetStatus"])
async def test_request_cut_by_end_of_stream_is_invalid(inference: Harness, method: str) -> None:
    await inference.expect(code_of_cut_call(inference.service.port, SERVICE + method), INVALID)


async def test_stream_cut_by_its_end_ends_at_once(inference: Harness) -> None:
    # gRPC's transport drops a message cut short by the end of its stream and reports just the end,
    # so the call ends as a stream closed after its last whole message: OK, no error to give.
    await inference.expect(code_of_cut_call(inference.service.port, SERVICE + "Generate"), OK)


async def test_stream_cancelled_mid_generation_frees_its_rows_and_its_queue(inference: Harness) -> None:
    call = await open_generate(inference.channel)
    for i in range(WINDOW):
        await call.write(
            submission(f"r{i}", stream_tokens=True, sampling=sampling(max_new_tokens=MAX_NEW_TOKENS))
        )
    assert (await call.read()).WhichOneof("event") == "delta"
    call.cancel()
    await inference.still_serving()
    assert await running_and_queued(inference.channel) == (0, 0)


async def running_and_queued(channel: grpc.aio.Channel) -> tuple[int, int]:
    stub = inference_pb2_grpc.InferenceServiceStub(channel)
    for _ in range(100):
        status = await stub.GetStatus(pb.GetStatusRequest(), metadata=AUTH, timeout=10)
        if status.running == status.queued == 0:
            break
        await asyncio.sleep(0.05)
    return status.running, status.queued


async def test_thousands_of_abandoned_streams_leave_rss_bounded(inference: Harness) -> None:
    def generate(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
        return inference_pb2_grpc.InferenceServiceStub(channel).Generate(metadata=AUTH, timeout=60)

    async def generating(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall:
        call = generate(channel)
        await call.write(submission("abandoned", sampling=sampling(max_new_tokens=MAX_NEW_TOKENS)))
        return call

    await abandon_calls(inference.service, generate, 250)  # warm up allocators and gRPC's pools
    before = inference.service.rss_mb()
    started = time.monotonic()
    await abandon_calls(inference.service, generate, 2000)
    for _ in range(4):  # streams abandoned with a request running on each
        async with inference.service.channel() as channel:
            calls = await asyncio.gather(*(generating(channel) for _ in range(50)))
            await asyncio.sleep(0.05)
            for call in calls[::2]:
                call.cancel()
    elapsed_s, growth_mb = time.monotonic() - started, inference.service.rss_mb() - before
    log.info(
        "abandoned calls",
        elapsed_s=round(elapsed_s, 1),
        rss_before_mb=round(before),
        rss_growth_mb=round(growth_mb, 1),
    )
    await inference.still_serving_after_a_flood()
    assert await running_and_queued(inference.channel) == (0, 0)
    assert elapsed_s < 90 and growth_mb < 50, (elapsed_s, growth_mb)


FIELD_CASES = [
    ("submit.request_id", submission("")),  # checked by the servicer
    ("submit.sampling.temperature", submission(sampling=sampling(temperature=-1.0))),  # by the wire
    ("submit.prompt_token_ids[1]", submission(prompt_token_ids=[5, VOCAB])),  # by the engine
    ("submit.sampling.max_new_tokens", submission(sampling=sampling(max_new_tokens=MAX_NEW_TOKENS + 1))),
]


@pytest.mark.parametrize(("field", "request_"), FIELD_CASES, ids=[c[0] for c in FIELD_CASES])
async def test_a_bad_field_is_named_by_its_path_from_the_request_root(
    inference: Harness, field: str, request_: pb.GenerateRequest
) -> None:
    """Whichever layer refuses it, a field is named from GenerateRequest down, with list indices."""
    call = await open_generate(inference.channel)
    try:
        await call.write(request_)
        code, response = await outcome(call, request_.submit.request_id)
    finally:
        call.cancel()
    details = [error_details_pb2.BadRequest() for d in response.error.status.details]
    for detail, packed in zip(details, response.error.status.details, strict=True):
        packed.Unpack(detail)
    assert code == INVALID and [v.field for d in details for v in d.field_violations] == [field]
