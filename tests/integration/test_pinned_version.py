"""Requests pinned to one weight version through a real inference server following a stand-in
trainer: the version published while they run is received at once (the receiver is not held up)
but swapped in only after the last of them, and a request pinned to a version the server no longer
holds is refused with FAILED_PRECONDITION naming the version it holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2

from pipelinerl.common.types import SamplingParams
from pipelinerl.inference.__main__ import build
from pipelinerl.inference.client import InferenceClient
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.inference.pinning import VersionNotHeld
from pipelinerl.inference.types import GenerationRequest, InferenceStatus
from pipelinerl.inference.v1 import inference_pb2 as pb
from pipelinerl.inference.v1 import inference_pb2_grpc
from tests.integration.processes import port_file_of, server_process

pytestmark = pytest.mark.slow

PROMPT = [1, 10, 11, 12, 13]
LONG = SamplingParams(temperature=0.0, max_new_tokens=1000)  # about 4 s each on a small CPU
WAIT_S = 60.0


async def status_until(
    client: InferenceClient, done: Callable[[InferenceStatus], bool], what: str
) -> InferenceStatus:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        status = await client.status(timeout_s=5)
        if done(status):
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def refusal_over_grpc(address: str, weight_version: int) -> pb.RequestError:
    """Submit one pinned request with the generated stubs alone, as a client in any language would."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = inference_pb2_grpc.InferenceServiceStub(channel).Generate()
        await call.read()  # Capacity
        submission = pb.Submission(
            request_id="pinned", prompt_token_ids=PROMPT, weight_version=weight_version
        )
        submission.sampling.max_new_tokens = 4
        await call.write(pb.GenerateRequest(submit=submission))
        response = await call.read()
        call.cancel()
    assert response.WhichOneof("event") == "error", response
    return response.error


async def test_a_pinned_request_holds_its_version_and_a_stale_one_is_refused_naming_the_held(
    tmp_path: Path,
) -> None:
    async with server_process("standin_trainer.py", tmp_path, "--versions", "2", "--weights", "tiny") as (
        _,
        port,
    ):
        # One row: the second pinned request waits in the queue, and the hold lasts for both.
        settings = InferenceSettings(
            port=0, model="tiny", trainer_address=f"127.0.0.1:{port}", receiver_id="inference-pinned",
            ignore_eos=True, max_running=1, queue_ahead=1,
        )  # fmt: skip
        server = await build(settings)
        await server.start()
        try:
            async with InferenceClient(server.address) as client, client.session() as session:
                started = asyncio.Event()
                evaluations = [
                    asyncio.create_task(
                        session.generate(
                            GenerationRequest(f"eval-{i}", PROMPT, LONG, weight_version=0),
                            on_delta=lambda _: started.set(),
                        )
                    )
                    for i in range(2)
                ]
                await started.wait()
                port_file_of("standin_trainer.py", tmp_path).with_suffix(".port.next").touch()
                received = await status_until(client, lambda s: s.weight_updates == 2, "version 1 received")
                assert not all(e.done() for e in evaluations), "the pinned requests ended before v1 came"
                assert received.weight_version.version == 0
                completions = await asyncio.gather(*evaluations)
                swapped = await status_until(client, lambda s: s.weight_version.version == 1, "the swap")

                with pytest.raises(VersionNotHeld) as refused:
                    await session.generate(GenerationRequest("stale", PROMPT, LONG, weight_version=0))
                current = await session.generate(
                    GenerationRequest("current", PROMPT, SamplingParams(max_new_tokens=8), weight_version=1)
                )
            error = await refusal_over_grpc(server.address, 0)
        finally:
            await server.stop(grace=1)

    for completion in completions:
        assert completion.tokens.versions == [0] * LONG.max_new_tokens
    assert swapped.failed_weight_updates == 0
    assert refused.value.held_version == 1 and refused.value.code == "FAILED_PRECONDITION"
    assert current.tokens.versions == [1] * 8

    assert (error.request_id, error.status.code) == ("pinned", code_pb2.FAILED_PRECONDITION)
    infos = []
    for detail in error.status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            infos.append(info)
    assert [dict(i.metadata) for i in infos] == [{"weight_version": "1"}], error.status
    assert infos[0].reason == "WEIGHT_VERSION_NOT_HELD"
