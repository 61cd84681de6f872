"""Property-based fuzzing of what services accept from the wire: arbitrary messages, built field by
field from their descriptors, and arbitrary bytes either convert or raise a documented
`PipelineError` (which the server maps to a status code) — never another exception, which a client
would see as UNKNOWN."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipelinerl.common import convert
from pipelinerl.common.errors import PipelineError
from pipelinerl.common.v1 import common_pb2
from pipelinerl.coordinator import convert as coordinator_convert
from pipelinerl.coordinator.server import CoordinatorServicer
from pipelinerl.coordinator.v1 import coordinator_pb2
from pipelinerl.inference import convert as inference_convert
from pipelinerl.inference.server import InferenceServicer
from pipelinerl.inference.v1 import inference_pb2
from pipelinerl.reward import convert as reward_convert
from pipelinerl.reward.server import RewardServicer
from pipelinerl.reward.v1 import reward_pb2
from pipelinerl.trainer import convert as trainer_convert
from pipelinerl.trainer.v1 import trainer_pb2
from pipelinerl.weights import convert as weights_convert
from tests.fakes import FakeBackend, FakeCoordinator, FakeReward

# Small enough for about a second per property, so the whole file stays well under 30 s.
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F = FieldDescriptor
_INTS = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1),
    F.TYPE_SINT32: (-(2**31), 2**31 - 1),
    F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1),
    F.TYPE_SINT64: (-(2**63), 2**63 - 1),
    F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1),
    F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1),
    F.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INTS:
        low, high = _INTS[field.type]
        # Small values hit the limits services check (0, 1, the vocabulary); extremes the rest.
        return st.integers(-3, 300).filter(lambda v: low <= v <= high) | st.integers(low, high)
    if field.type == F.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values]) | st.integers(-(2**31), 2**31 - 1)
    return {
        F.TYPE_FLOAT: st.floats(width=32),
        F.TYPE_DOUBLE: st.floats(),
        F.TYPE_BOOL: st.booleans(),
        F.TYPE_STRING: st.text(max_size=24),
        F.TYPE_BYTES: st.binary(max_size=24),
    }[field.type]


def messages(descriptor: Descriptor, depth: int = 2) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type with any subset of fields set to any value, nested `depth` deep."""
    cls = message_factory.GetMessageClass(descriptor)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for field in descriptor.fields:
            if field.message_type is not None and field.message_type.GetOptions().map_entry:
                # a map of scalars, the only kind of map the contracts have
                key, item = (field.message_type.fields_by_name[name] for name in ("key", "value"))
                entries = draw(st.dictionaries(_scalar(key), _scalar(item), max_size=4))
                getattr(msg, field.name).update(entries)
                continue
            if field.message_type is not None and depth == 0:
                continue
            value = messages(field.message_type, depth - 1) if field.message_type else _scalar(field)
            if field.is_repeated:
                values = draw(st.lists(value, max_size=4))
                container = getattr(msg, field.name)
                for v in values:
                    container.add().CopyFrom(v) if field.message_type else container.append(v)
            elif draw(st.booleans()):
                v = draw(value)
                getattr(msg, field.name).CopyFrom(v) if field.message_type else setattr(msg, field.name, v)
        return msg

    return build()


# Every converter of what a service receives: requests (server side) and responses (client side).
CONVERTERS: list[tuple[type[Message], Callable[[Any], object]]] = [
    (common_pb2.SamplingParams, convert.sampling_from_proto),
    (common_pb2.TokenSequence, convert.tokens_from_proto),
    (common_pb2.Sample, convert.sample_from_proto),
    (common_pb2.WeightVersion, convert.version_from_proto),
    (common_pb2.Checksum, weights_convert.checksum_from_proto),
    (common_pb2.WeightLayout, weights_convert.layout_from_proto),
    (common_pb2.TensorChunk, weights_convert.chunk_from_proto),
    (coordinator_pb2.RunSpec, coordinator_convert.spec_from_proto),
    (coordinator_pb2.GetRunRequest, lambda msg: coordinator_convert.run_id_from_proto(msg.run_id)),
    (coordinator_pb2.Run, coordinator_convert.run_from_proto),
    (coordinator_pb2.Progress, coordinator_convert.progress_from_proto),
    (coordinator_pb2.EvaluationSpec, coordinator_convert.evaluation_from_proto),
    (coordinator_pb2.EvaluationResult, coordinator_convert.evaluation_result_from_proto),
    (reward_pb2.ScoreItem, reward_convert.item_from_proto),
    (reward_pb2.ScoreResult, reward_convert.result_from_proto),
    (reward_pb2.GetStatusResponse, reward_convert.stats_from_proto),
    (inference_pb2.Completion, inference_convert.completion_from_proto),
    (inference_pb2.GetStatusResponse, inference_convert.status_from_proto),
    (trainer_pb2.SampleAck, trainer_convert.ack_from_proto),
    (trainer_pb2.WatchWeightsResponse, trainer_convert.notice_from_proto),
    (trainer_pb2.GetStatusResponse, trainer_convert.status_from_proto),
]
IDS = [cls.DESCRIPTOR.full_name for cls, _ in CONVERTERS]


@pytest.mark.parametrize(("cls", "converter"), CONVERTERS, ids=IDS)
def test_converters_raise_only_domain_errors(cls: type[Message], converter: Callable[[Any], object]) -> None:
    @FUZZ
    @given(messages(cls.DESCRIPTOR))
    def check(msg: Message) -> None:
        with contextlib.suppress(PipelineError):
            converter(msg)

    check()


@pytest.mark.parametrize(("cls", "converter"), CONVERTERS, ids=IDS)
def test_random_bytes_fail_to_parse_or_convert_cleanly(
    cls: type[Message], converter: Callable[[Any], object]
) -> None:
    serialized = messages(cls.DESCRIPTOR).map(lambda m: m.SerializeToString())
    truncated = serialized.flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n]))

    @FUZZ
    @given(st.binary(max_size=64) | truncated)
    def check(data: bytes) -> None:
        try:
            msg = cls.FromString(data)
        except DecodeError:
            return
        with contextlib.suppress(PipelineError):
            converter(msg)

    check()


def _run(coroutine: Any) -> None:
    with contextlib.suppress(PipelineError):
        asyncio.run(coroutine)


@FUZZ
@given(messages(coordinator_pb2.StartRunRequest.DESCRIPTOR))
def test_coordinator_servicer_start_run(request: coordinator_pb2.StartRunRequest) -> None:
    _run(CoordinatorServicer(FakeCoordinator()).StartRun(request, None))  # type: ignore[arg-type]


@FUZZ
@given(messages(reward_pb2.ScoreRequest.DESCRIPTOR))
def test_reward_servicer_score(request: reward_pb2.ScoreRequest) -> None:
    _run(RewardServicer(FakeReward()).Score(request, None))  # type: ignore[arg-type]


@FUZZ
@given(st.lists(messages(inference_pb2.GenerateRequest.DESCRIPTOR), min_size=1, max_size=4))
def test_inference_servicer_generate(requests: list[inference_pb2.GenerateRequest]) -> None:
    """A Generate stream of fuzzed requests answers each with a capacity, a completion or an error."""

    async def stream() -> None:
        async def incoming() -> AsyncIterator[inference_pb2.GenerateRequest]:
            for request in requests:
                yield request

        servicer = InferenceServicer(FakeBackend(step_s=0))
        async with asyncio.timeout(10):
            async for response in servicer.Generate(incoming(), None):  # type: ignore[arg-type]
                assert response.WhichOneof("event") in ("capacity", "delta", "completion", "error")

    _run(stream())
