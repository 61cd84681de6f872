"""Malformed and hostile requests to a real coordinator (a subprocess with a bearer token, driving
in-process fake inference, reward and trainer services): each gets its documented status, and the
coordinator still answers for a valid run after it."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.log import get_logger
from pipelinerl.common.server import GrpcServer
from pipelinerl.common.settings import ServiceSettings
from pipelinerl.common.v1 import common_pb2
from pipelinerl.coordinator.v1 import coordinator_pb2 as pb
from pipelinerl.coordinator.v1 import coordinator_pb2_grpc
from pipelinerl.inference import server as inference_server
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate
from pipelinerl.reward import server as reward_server
from pipelinerl.trainer import server as trainer_server
from tests.fakes import FakeBackend, FakeReward, FakeTrainer
from tests.integration.hostile import (
    AUTH,
    AUTH_CASES,
    BAD_UTF8,
    DEADLINE,
    EXHAUSTED,
    INVALID,
    NOT_FOUND,
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
    raw_stream,
    raw_unary,
    stream_code,
)

log = get_logger(__name__)
pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

SERVICE = "/pipelinerl.coordinator.v1.CoordinatorService/"
OVER_LIMIT = FakeBackend.limits.max_new_tokens + 1
INT32_MAX = 2**31 - 1
NAN, INF = math.nan, math.inf


class StrictBackend(FakeBackend):
    """Refuses stop token ids outside a vocabulary of 100, as the real engine does (the coordinator
    cannot know the vocabulary: Capacity does not advertise it)."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        if any(not 0 <= t < 100 for t in request.sampling.stop_token_ids):
            raise InvalidArgument.field("submit.sampling.stop_token_ids", "outside the vocabulary")
        return super().generate(request)


def sampling(**fields: object) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**{"max_new_tokens": 4, **fields})  # type: ignore[arg-type]


def spec(**fields: object) -> pb.RunSpec:
    values: dict[str, object] = {
        "dataset": "builtin:copy",
        "group_size": 2,
        "max_samples": 4,
        "sampling": sampling(),
        "mode": pb.MODE_PIPELINE,
        "max_in_flight": 4,
    }
    return pb.RunSpec(**{**values, **fields})  # type: ignore[arg-type]


def stub(h: Harness) -> coordinator_pb2_grpc.CoordinatorServiceStub:
    return coordinator_pb2_grpc.CoordinatorServiceStub(h.channel)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def coordinator(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Harness]:
    tmp = tmp_path_factory.mktemp("coordinator")
    (tmp / "no_answer.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp / "not_json.jsonl").write_text("{this is not json\n")
    (tmp / "number_prompt.jsonl").write_text('{"prompt": 12, "answer": "12"}\n')
    # Slow enough fake steps that the endless run below stays light, fast enough for short runs.
    backend = StrictBackend(step_s=0.05)
    registrations = [
        inference_server.registration(inference_server.InferenceServicer(backend)),
        reward_server.registration(FakeReward()),
        trainer_server.registration(FakeTrainer()),
    ]
    fakes = GrpcServer(ServiceSettings(host="127.0.0.1", port=0, drain_seconds=0), registrations)
    await fakes.start()
    address = fakes.address
    args = ["--inference-addresses", f'["{address}"]', "--reward-address", address]
    args += ["--trainer-address", address, "--journal-path", str(tmp / "journal.sqlite")]
    try:
        async with harness(
            "pipelinerl.coordinator",
            tmp,
            *args,
            memory_limit_gib=4,
            serves=answers_for_a_valid_run,
            setup=start_runs,
        ) as h:
            yield h
    finally:
        await fakes.stop(grace=0)


async def start_runs(channel: grpc.aio.Channel) -> None:
    """A run that completes at once and one that runs until stopped (started again after a restart)."""
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
    for run_id, max_samples in (("ok", 4), ("endless", 0)):
        request = pb.StartRunRequest(run_id=run_id, spec=spec(max_samples=max_samples))
        await stub.StartRun(request, metadata=AUTH, timeout=20)


async def answers_for_a_valid_run(channel: grpc.aio.Channel) -> None:
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
    response = await stub.GetRun(pb.GetRunRequest(run_id="ok"), metadata=AUTH, timeout=20)
    assert response.run.state in (pb.RUN_STATE_RUNNING, pb.RUN_STATE_COMPLETED), response.run
    response = await stub.GetRun(pb.GetRunRequest(run_id="endless"), metadata=AUTH, timeout=20)
    assert response.run.state == pb.RUN_STATE_RUNNING, response.run


START_CASES = [
    ("run id with a slash", "../x", spec(), INVALID),
    ("run id of 65 characters", "r" * 65, spec(), INVALID),
    ("run id with a space", "a b", spec(), INVALID),
    ("run id not ASCII", "rün", spec(), INVALID),
    ("no spec", None, None, INVALID),
    ("empty dataset", None, spec(dataset=""), INVALID),
    ("unknown builtin task", None, spec(dataset="builtin:nope"), INVALID),
    ("builtin with 0 digits", None, spec(dataset="builtin:copy:0"), INVALID),
    ("builtin with 33 digits", None, spec(dataset="builtin:copy:33"), INVALID),
    ("builtin digits not a number", None, spec(dataset="builtin:copy:x"), INVALID),
    ("missing dataset file", None, spec(dataset="/nonexistent/problems.jsonl"), INVALID),
    ("dataset not jsonl or parquet", None, spec(dataset="/etc/passwd"), INVALID),
    ("dataset without answers", None, spec(dataset="{tmp}/no_answer.jsonl"), INVALID),
    ("dataset of invalid JSON", None, spec(dataset="{tmp}/not_json.jsonl"), INVALID),
    ("dataset with a number as prompt", None, spec(dataset="{tmp}/number_prompt.jsonl"), INVALID),
    ("group size 0", None, spec(group_size=0), INVALID),
    ("group size 1", None, spec(group_size=1), INVALID),
    ("group size negative", None, spec(group_size=-4), INVALID),
    ("max samples negative", None, spec(max_samples=-1), INVALID),
    ("mode unspecified", None, spec(mode=pb.MODE_UNSPECIFIED), INVALID),
    ("mode unknown", None, spec(mode=7), INVALID),
    ("max in flight below group size", None, spec(max_in_flight=1), INVALID),
    ("max in flight negative", None, spec(max_in_flight=-1), INVALID),
    ("max new tokens 0", None, spec(sampling=sampling(max_new_tokens=0)), INVALID),
    ("max new tokens negative", None, spec(sampling=sampling(max_new_tokens=-1)), INVALID),
    ("max new tokens over the limit", None, spec(sampling=sampling(max_new_tokens=OVER_LIMIT)), INVALID),
    ("max new tokens int32 max", None, spec(sampling=sampling(max_new_tokens=INT32_MAX)), INVALID),
    ("temperature NaN", None, spec(sampling=sampling(temperature=NAN)), INVALID),
    ("temperature inf", None, spec(sampling=sampling(temperature=INF)), INVALID),
    ("temperature negative", None, spec(sampling=sampling(temperature=-0.5)), INVALID),
    ("temperature over 100", None, spec(sampling=sampling(temperature=100.5)), INVALID),
    ("top p 0", None, spec(sampling=sampling(top_p=0.0)), INVALID),
    ("top p NaN", None, spec(sampling=sampling(top_p=NAN)), INVALID),
    ("top p over 1", None, spec(sampling=sampling(top_p=1.5)), INVALID),
    ("top k negative", None, spec(sampling=sampling(top_k=-1)), INVALID),
    ("stop token negative", None, spec(sampling=sampling(stop_token_ids=[-1])), INVALID),
    ("17 stop strings", None, spec(sampling=sampling(stop=[str(i) for i in range(17)])), INVALID),
    ("empty stop string", None, spec(sampling=sampling(stop=[""])), INVALID),
    ("stop string of 257 bytes", None, spec(sampling=sampling(stop=["x" * 257])), INVALID),
    ("largest seed, valid", "seeded", spec(seed=2**64 - 1), OK),
    ("running id with another spec", "endless", spec(group_size=4), OK),
]


@pytest.mark.parametrize(("name", "run_id", "spec_", "code"), START_CASES, ids=[c[0] for c in START_CASES])
async def test_start_run(
    coordinator: Harness, name: str, run_id: str | None,
    spec_: pb.RunSpec | None, code: grpc.StatusCode,
) -> None:  # fmt: skip
    # A run id of its own per case: a journalled run keeps the spec it was first started with.
    run_id = run_id if run_id is not None else re.sub(r"[^A-Za-z0-9]+", "-", name)
    request = pb.StartRunRequest(run_id=run_id, spec=spec_)
    tmp = coordinator.service.log_path.parent
    request.spec.dataset = request.spec.dataset.replace("{tmp}", str(tmp))
    await coordinator.expect(code_of(stub(coordinator).StartRun(request, metadata=AUTH, timeout=20)), code)


async def test_a_rejected_start_does_not_claim_the_run_id(coordinator: Harness) -> None:
    s = stub(coordinator)
    bad = pb.StartRunRequest(run_id="retried", spec=spec(dataset="/nonexistent/problems.jsonl"))
    assert await code_of(s.StartRun(bad, metadata=AUTH, timeout=20)) == INVALID
    good = pb.StartRunRequest(run_id="retried", spec=spec())
    assert await code_of(s.StartRun(good, metadata=AUTH, timeout=20)) == OK


async def test_a_run_whose_every_attempt_is_refused_does_not_spin(coordinator: Harness) -> None:
    """Refused at StartRun, or FAILED soon: not dispatching refused attempts forever."""
    s = stub(coordinator)
    refused = spec(max_samples=0, sampling=sampling(stop_token_ids=[10**6]))
    code = await code_of(
        s.StartRun(pb.StartRunRequest(run_id="refused", spec=refused), metadata=AUTH, timeout=20)
    )
    state = None
    try:
        for _ in range(50 if code == OK else 0):
            run = (await s.GetRun(pb.GetRunRequest(run_id="refused"), metadata=AUTH, timeout=20)).run
            if (state := run.state) == pb.RUN_STATE_FAILED:
                break
            await asyncio.sleep(0.1)
    finally:
        if code == OK:
            await s.StopRun(pb.StopRunRequest(run_id="refused"), metadata=AUTH, timeout=30)
    await coordinator.still_serving()
    assert code == INVALID or state == pb.RUN_STATE_FAILED, (code, run.progress)


async def test_a_running_run_keeps_its_spec(coordinator: Harness) -> None:
    response = await stub(coordinator).GetRun(pb.GetRunRequest(run_id="endless"), metadata=AUTH, timeout=20)
    assert response.run.spec.group_size == 2 and response.run.spec.max_samples == 0


ID_CASES = [
    ("empty", "", INVALID),
    ("slash", "a/b", INVALID),
    ("NUL", "a\x00", INVALID),
    ("65 characters", "r" * 65, INVALID),
    ("unknown", "never-started", NOT_FOUND),
]


@pytest.mark.parametrize("method", ["GetRun", "StopRun", "WatchRun"])
@pytest.mark.parametrize(("name", "run_id", "code"), ID_CASES, ids=[c[0] for c in ID_CASES])
async def test_bad_run_id(
    coordinator: Harness, method: str, name: str, run_id: str, code: grpc.StatusCode
) -> None:
    s = stub(coordinator)
    if method == "WatchRun":
        call = stream_code(s.WatchRun(pb.WatchRunRequest(run_id=run_id), metadata=AUTH, timeout=20))
    else:
        call = code_of(
            getattr(s, method)(getattr(pb, f"{method}Request")(run_id=run_id), metadata=AUTH, timeout=20)
        )
    await coordinator.expect(call, code)


RAW_CASES = [
    ("StartRun", UNDECODABLE),
    ("StartRun", TRUNCATED),
    ("StartRun", BAD_UTF8),
    ("GetRun", UNDECODABLE),
    ("GetRun", BAD_UTF8),
    ("StopRun", UNDECODABLE),
    ("WatchRun", UNDECODABLE),
    ("WatchRun", BAD_UTF8),
]


@pytest.mark.parametrize(("method", "data"), RAW_CASES, ids=[f"{m}-{d.hex()}" for m, d in RAW_CASES])
async def test_undecodable_bytes(coordinator: Harness, method: str, data: bytes) -> None:
    if method == "WatchRun":
        call = raw_stream(coordinator.channel, SERVICE + method, data, streaming_request=False)
    else:
        call = raw_unary(coordinator.channel, SERVICE + method, data)
    await coordinator.expect(call, INVALID)


@pytest.mark.parametrize("method", ["StartRun", "GetRun", "StopRun", "WatchRun"])
@pytest.mark.parametrize("auth", sorted(AUTH_CASES))
async def test_bad_token(coordinator: Harness, method: str, auth: str) -> None:
    data = pb.GetRunRequest(run_id="ok").SerializeToString()  # field 1 is the run id in all four
    if method == "WatchRun":
        call = coordinator.channel.unary_stream(SERVICE + method)(data, metadata=AUTH_CASES[auth], timeout=20)
        await coordinator.expect(stream_code(call), UNAUTHENTICATED)
    else:
        await coordinator.expect(
            raw_unary(coordinator.channel, SERVICE + method, data, AUTH_CASES[auth]), UNAUTHENTICATED
        )


async def test_oversize_message_is_resource_exhausted(coordinator: Harness) -> None:
    request = pb.StartRunRequest(run_id="big", spec=spec(dataset="x" * OVERSIZE_BYTES))
    await coordinator.expect(
        code_of(stub(coordinator).StartRun(request, metadata=AUTH, timeout=20)), EXHAUSTED
    )


async def test_deadline_ends_a_watch(coordinator: Harness) -> None:
    call = stub(coordinator).WatchRun(pb.WatchRunRequest(run_id="endless"), metadata=AUTH, timeout=0.5)
    await coordinator.expect(stream_code(call), DEADLINE)


@pytest.mark.parametrize("rst_stream", [True, False], ids=["cancelled", "dropped"])
@pytest.mark.parametrize("method", ["StartRun", "WatchRun"])
async def test_stream_cut_mid_message(coordinator: Harness, method: str, rst_stream: bool) -> None:
    half_sent_message(coordinator.service.port, SERVICE + method, rst_stream)
    await coordinator.still_serving()


@pytest.mark.parametrize("method", ["StartRun", "GetRun", "StopRun", "WatchRun", "RegisterInferenceServer"])
async def test_request_cut_by_end_of_stream_is_invalid(coordinator: Harness, method: str) -> None:
    await coordinator.expect(code_of_cut_call(coordinator.service.port, SERVICE + method), INVALID)


async def test_thousands_of_abandoned_watch_streams_leave_rss_bounded(coordinator: Harness) -> None:
    def watch(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamCall:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        return stub.WatchRun(pb.WatchRunRequest(run_id="endless"), metadata=AUTH, timeout=60)

    await abandon_calls(coordinator.service, watch, 250)  # warm up allocators and gRPC's pools
    before = coordinator.service.rss_mb()
    started = time.monotonic()
    await abandon_calls(coordinator.service, watch, 2000)
    elapsed_s, growth_mb = time.monotonic() - started, coordinator.service.rss_mb() - before
    log.info(
        "abandoned calls",
        elapsed_s=round(elapsed_s, 1),
        rss_before_mb=round(before),
        rss_growth_mb=round(growth_mb, 1),
    )
    await coordinator.still_serving_after_a_flood()
    assert elapsed_s < 60 and growth_mb < 50, (elapsed_s, growth_mb)


async def test_huge_group_is_rejected(coordinator: Harness) -> None:
    # Last but one: until it is rejected, the coordinator builds 2**31 attempts and stalls.
    request = pb.StartRunRequest(run_id="huge", spec=spec(group_size=INT32_MAX, max_in_flight=INT32_MAX))
    await coordinator.expect(code_of(stub(coordinator).StartRun(request, metadata=AUTH, timeout=20)), INVALID)


async def test_valid_runs_still_complete_and_stop(coordinator: Harness) -> None:
    s = stub(coordinator)
    await s.StartRun(pb.StartRunRequest(run_id="last", spec=spec()), metadata=AUTH, timeout=20)
    async for update in s.WatchRun(pb.WatchRunRequest(run_id="last"), metadata=AUTH, timeout=60):
        state = update.run.state
    assert state == pb.RUN_STATE_COMPLETED and update.run.progress.trained == 4
    stopped = await s.StopRun(pb.StopRunRequest(run_id="endless"), metadata=AUTH, timeout=30)
    assert stopped.run.state in (pb.RUN_STATE_STOPPING, pb.RUN_STATE_STOPPED)
