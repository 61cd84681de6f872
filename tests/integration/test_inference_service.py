"""The Generate stream over gRPC: flow control, per-request errors and cancellation with a fake engine;
numerically extreme sampling and a dead engine loop with the real one."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl.common.errors import InvalidArgument, PipelineError
from pipelinerl.common.model import load_model
from pipelinerl.common.types import FinishReason, SamplingParams
from pipelinerl.inference import server as inference_server
from pipelinerl.inference.__main__ import build
from pipelinerl.inference.client import InferenceClient
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.inference.engine import InferenceEngine
from pipelinerl.inference.model_info import tokenizer_sha256
from pipelinerl.inference.types import GenerationRequest
from pipelinerl.inference.v1 import inference_pb2 as pb
from pipelinerl.inference.v1 import inference_pb2_grpc
from tests.fakes import FakeBackend


@pytest.fixture
async def backend_address(start_server):
    backend = FakeBackend(step_s=0.005)
    address = await start_server(inference_server.registration(inference_server.InferenceServicer(backend)))
    return backend, address


async def test_many_requests_never_exceed_the_advertised_window(backend_address) -> None:
    backend, address = backend_address
    async with InferenceClient(address) as client, client.session() as session:
        assert session.window == FakeBackend.limits.max_running
        requests = [GenerationRequest(f"r{i}", [i], SamplingParams(max_new_tokens=5)) for i in range(12)]
        completions = await asyncio.gather(*(session.generate(r) for r in requests))
    assert backend.peak_running == FakeBackend.limits.max_running
    for i, c in enumerate(completions):
        assert c.tokens.token_ids == [(i + k) % 100 for k in range(1, 6)]
        assert c.finish_reason is FinishReason.LENGTH and c.prompt_token_ids == [i]


@pytest.mark.parametrize("server_batches", [True, False])
async def test_concurrent_requests_share_messages_when_the_server_takes_batches(
    start_server, monkeypatch: pytest.MonkeyPatch, server_batches: bool
) -> None:
    """Requests submitted together leave in one SubmissionBatch and come back in CompletionBatches;
    to a server that does not say `accepts_batches` (one that predates them) each goes alone."""
    if not server_batches:
        real = inference_server.capacity_to_proto

        def capacity_without_batches(*args: object) -> pb.GenerateResponse:
            response = real(*args)  # type: ignore[arg-type]
            response.capacity.accepts_batches = False
            return response

        monkeypatch.setattr(inference_server, "capacity_to_proto", capacity_without_batches)
    places: list[str] = []
    real_submit = inference_server._GenerateStream._submit

    def submit(stream: object, msg: pb.Submission, where: str, *, batched: bool = False) -> None:
        places.append(where)
        real_submit(stream, msg, where, batched=batched)  # type: ignore[arg-type]

    monkeypatch.setattr(inference_server._GenerateStream, "_submit", submit)
    address = await start_server(
        inference_server.registration(inference_server.InferenceServicer(FakeBackend()))
    )
    async with InferenceClient(address) as client, client.session() as session:
        requests = [GenerationRequest(f"r{i}", [i], SamplingParams(max_new_tokens=3)) for i in range(8)]
        completions = await asyncio.gather(*(session.generate(r) for r in requests))
    assert [c.tokens.token_ids for c in completions] == [[i + 1, i + 2, i + 3] for i in range(8)]
    if server_batches:
        window = FakeBackend.limits.max_running  # 4: the first four leave together, the rest as slots free
        assert places[:window] == [f"submit_batch.submissions[{i}]" for i in range(window)], places
        assert len(places) == 8 and all(place.startswith("submit_batch.") for place in places), places
    else:
        assert places == ["submit"] * 8


async def test_a_request_cancelled_before_its_batch_leaves_never_reaches_the_server(backend_address) -> None:
    backend, address = backend_address
    async with InferenceClient(address) as client, client.session() as session:
        doomed = asyncio.create_task(session.generate(GenerationRequest("doomed", [1], SamplingParams())))
        kept = asyncio.create_task(
            session.generate(GenerationRequest("kept", [2], SamplingParams(max_new_tokens=2)))
        )
        await asyncio.sleep(0)  # both are in the outbox; the writer has not run yet
        doomed.cancel()
        assert (await kept).tokens.token_ids == [3, 4]
        with pytest.raises(asyncio.CancelledError):
            await doomed
        assert session.in_flight == 0
    assert backend.peak_running == 1


async def test_streamed_deltas_carry_every_token_once(backend_address) -> None:
    """The last step's token too: a client that renders deltas sees the whole completion."""
    _, address = backend_address
    streamed: list[int] = []
    async with InferenceClient(address) as client, client.session() as session:
        request = GenerationRequest("s", [7], SamplingParams(max_new_tokens=6))
        completion = await session.generate(request, on_delta=lambda d: streamed.extend(d.token_ids))
    assert streamed == completion.tokens.token_ids == [8, 9, 10, 11, 12, 13]


async def test_bad_request_fails_alone_and_the_stream_goes_on(backend_address) -> None:
    _, address = backend_address
    async with InferenceClient(address) as client, client.session() as session:
        good = asyncio.create_task(
            session.generate(GenerationRequest("ok", [1], SamplingParams(max_new_tokens=8)))
        )
        with pytest.raises(InvalidArgument) as exc:
            await session.generate(GenerationRequest("bad", [1], SamplingParams(max_new_tokens=0)))
        # The session batches its submissions: a field is named by its place in the batch.
        assert re.fullmatch(
            r"submit_batch\.submissions\[\d\]\.sampling\.max_new_tokens", exc.value.violations[0].field
        )
        with pytest.raises(InvalidArgument) as exc:
            await session.generate(GenerationRequest("long", [1], SamplingParams(max_new_tokens=500)))
        assert exc.value.violations[0].field == "submit_batch.submissions[0].sampling.max_new_tokens"
        assert len((await good).tokens) == 8
        # a second request under the id of one in flight: its answers could not be told apart
        held = asyncio.create_task(
            session.generate(GenerationRequest("held", [1], SamplingParams(max_new_tokens=32)))
        )
        await asyncio.sleep(0)  # the first is in flight
        with pytest.raises(InvalidArgument) as exc:
            await session.generate(GenerationRequest("held", [1], SamplingParams(max_new_tokens=8)))
        assert exc.value.violations[0].field == "request_id"
        assert len((await held).tokens) == 32


async def test_cancel_aborts_on_the_engine_and_over_capacity_is_refused(backend_address) -> None:
    backend, address = backend_address
    async with InferenceClient(address) as client, client.session() as session:
        task = asyncio.create_task(
            session.generate(GenerationRequest("c", [1], SamplingParams(max_new_tokens=30)))
        )
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            if backend.aborted:
                break
            await asyncio.sleep(0.01)
        assert backend.aborted == ["c"]

    # A raw client that ignores the window gets RESOURCE_EXHAUSTED for the extra request only.
    async with grpc.aio.insecure_channel(address) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate()
        capacity = await call.read()
        window = capacity.capacity.max_in_flight
        for i in range(window + 1):
            submit = pb.Submission(request_id=f"r{i}", prompt_token_ids=[1])
            submit.sampling.max_new_tokens = 3
            await call.write(pb.GenerateRequest(submit=submit))
        await call.done_writing()
        events = []
        while (event := await call.read()) is not grpc.aio.EOF:
            events.append(event)
    errors = [e.error for e in events if e.WhichOneof("event") == "error"]
    assert [(e.request_id, e.status.code) for e in errors] == [
        (f"r{window}", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    ]
    assert sum(e.WhichOneof("event") == "completion" for e in events) == window


@pytest.fixture
async def real_engine_server():
    server = await build(InferenceSettings(port=0, model="tiny", ignore_eos=True))
    await server.start()
    yield server
    await server.stop(grace=0)


async def health_of(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return response.status


async def test_a_near_zero_temperature_fails_no_request_on_the_real_engine(real_engine_server) -> None:
    async with InferenceClient(real_engine_server.address) as client, client.session() as session:
        cold = SamplingParams(temperature=1e-45, max_new_tokens=6)  # a float32 denormal on the wire
        completions = await asyncio.gather(
            session.generate(GenerationRequest("cold", [1, 10, 11], cold)),
            session.generate(GenerationRequest("warm", [1, 12], SamplingParams(max_new_tokens=6, seed=1))),
        )
        later = await session.generate(
            GenerationRequest("later", [1, 10, 11], SamplingParams(temperature=0, max_new_tokens=6))
        )
    assert [len(c.tokens) for c in completions] == [6, 6]
    assert all(math.isfinite(lp) for c in completions for lp in c.tokens.logprobs)
    assert completions[0].tokens.token_ids == later.tokens.token_ids  # near-zero temperature is greedy
    assert await health_of(real_engine_server.address) == health_pb2.HealthCheckResponse.SERVING


async def test_capacity_and_status_advertise_the_model_a_client_tokenizes_for(real_engine_server) -> None:
    tokenizer = load_model("tiny").tokenizer
    async with InferenceClient(real_engine_server.address) as client:
        async with client.session() as session:
            advertised = session.model_info
        status = await client.status()
    assert advertised == status.model_info
    assert advertised is not None
    assert advertised.model == advertised.tokenizer == "tiny"
    assert advertised.vocab_size == len(tokenizer)
    assert advertised.eos_token_ids == (tokenizer.eos_token_id,)
    assert advertised.pad_token_id == tokenizer.pad_token_id
    assert advertised.bos_token_id == tokenizer.bos_token_id
    serialized = tokenizer.backend_tokenizer.to_str().encode()  # the digest the contract describes
    assert (
        advertised.tokenizer_sha256 == tokenizer_sha256(tokenizer) == hashlib.sha256(serialized).hexdigest()
    )
    # The advertised range is the one the server enforces: its last id is accepted, the next is not.
    async with InferenceClient(real_engine_server.address) as client, client.session() as session:
        last = GenerationRequest("last", [advertised.vocab_size - 1], SamplingParams(max_new_tokens=1))
        assert len((await session.generate(last)).tokens) == 1
        with pytest.raises(InvalidArgument):
            await session.generate(
                GenerationRequest("past", [advertised.vocab_size], SamplingParams(max_new_tokens=1))
            )


async def test_the_next_turn_of_an_episode_takes_its_kept_cache_over_grpc(real_engine_server) -> None:
    opening, sampling = [1, 10, 11, 12], SamplingParams(max_new_tokens=6, seed=3)
    async with InferenceClient(real_engine_server.address) as client, client.session() as session:
        first = await session.generate(GenerationRequest("e-t1", opening, sampling, prompt_cache_key="e"))
        prompt = opening + first.tokens.token_ids + [13, 14]  # the next turn: the reply appended
        second = await session.generate(GenerationRequest("e-t2", prompt, sampling, prompt_cache_key="e"))
        fresh = await session.generate(GenerationRequest("fresh", prompt, sampling))
    # Everything but the reply and the last sampled token (never fed through the model) was reused.
    reused = real_engine_server.registry.get_sample_value("pipelinerl_inference_reused_prompt_tokens_total")
    assert reused == len(opening) + len(first.tokens) - 1
    assert second.tokens.token_ids == fresh.tokens.token_ids
    assert second.tokens.logprobs == pytest.approx(fresh.tokens.logprobs, abs=1e-4)


async def test_an_engine_whose_loop_died_reports_not_serving(
    real_engine_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async with InferenceClient(real_engine_server.address) as client, client.session() as session:
        await session.generate(GenerationRequest("ok", [1, 10], SamplingParams(max_new_tokens=2)))
        monkeypatch.setattr(InferenceEngine, "_swap_staged_weights", broken)  # every step starts with it
        for request_id in ("dies", "after"):
            with pytest.raises(PipelineError) as exc:
                await session.generate(
                    GenerationRequest(request_id, [1, 10], SamplingParams(max_new_tokens=2))
                )
            assert exc.value.code == "UNAVAILABLE"
    for _ in range(50):
        if await health_of(real_engine_server.address) == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        await asyncio.sleep(0.05)
    assert await health_of(real_engine_server.address) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_requests_beyond_the_rows_wait_at_the_server_and_start_as_a_row_frees() -> None:
    """Two rows and `queue_ahead` 1: a stream takes three requests at once and refuses a fourth;
    the third waits for a row and starts when the shortest frees one, so it finishes before the
    longest instead of after it."""
    settings = InferenceSettings(port=0, model="tiny", ignore_eos=True, max_running=2, queue_ahead=1)
    server = await build(settings)
    await server.start()
    lengths = {"short": 2, "long": 24, "queued": 4, "over": 1}
    submissions = [pb.Submission(request_id=request_id, prompt_token_ids=[1, 10]) for request_id in lengths]
    for submission in submissions:
        submission.sampling.max_new_tokens = lengths[submission.request_id]
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = inference_pb2_grpc.InferenceServiceStub(channel).Generate()
            capacity = await call.read()
            await call.write(pb.GenerateRequest(submit_batch=pb.SubmissionBatch(submissions=submissions)))
            await call.done_writing()
            events = []
            while (event := await call.read()) is not grpc.aio.EOF:
                events.append(event)
    finally:
        await server.stop(grace=0)
    assert capacity.capacity.max_in_flight == 3
    errors = [e.error for e in events if e.WhichOneof("event") == "error"]
    assert [(e.request_id, e.status.code) for e in errors] == [
        ("over", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
    ]
    done = [c for e in events if e.WhichOneof("event") == "completions" for c in e.completions.completions]
    assert [c.request_id for c in done] == ["short", "queued", "long"]
    assert [len(c.completion.token_ids) for c in done] == [2, 4, 24]
