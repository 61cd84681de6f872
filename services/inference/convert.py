"""Inference messages <-> inference domain types, both directions (servicer and client)."""

from __future__ import annotations

from collections.abc import Mapping

from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2

from pipelinerl.common import convert
from pipelinerl.common.errors import PipelineError
from pipelinerl.common.status import error_from_status, item_status
from pipelinerl.inference.pinning import VersionNotHeld
from pipelinerl.inference.types import Completion, GenerationRequest, InferenceStatus, Limits, ModelInfo
from pipelinerl.inference.v1 import inference_pb2 as pb

VERSION_NOT_HELD = "WEIGHT_VERSION_NOT_HELD"
"""`ErrorInfo.reason` of a pinned request refused at another version (AIP-193)."""
ERROR_DOMAIN = "inference.pipelinerl"


def submission_to_proto(
    request: GenerationRequest, *, stream_tokens: bool, trace: Mapping[str, str]
) -> pb.Submission:
    return pb.Submission(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        prompt_text=request.prompt_text,
        sampling=convert.sampling_to_proto(request.sampling),
        stream_tokens=stream_tokens,
        trace=trace,
        weight_version=request.weight_version,
        prompt_cache_key=request.prompt_cache_key,
    )


def request_from_proto(msg: pb.Submission, prompt_token_ids: list[int], where: str) -> GenerationRequest:
    """The request of `msg`, whose prompt the servicer has resolved (tokenized `prompt_text`)."""
    return GenerationRequest(
        msg.request_id,
        prompt_token_ids,
        convert.sampling_from_proto(msg.sampling, f"{where}.sampling"),
        msg.stream_tokens,
        weight_version=msg.weight_version if msg.HasField("weight_version") else None,
        prompt_cache_key=msg.prompt_cache_key,
    )


def request_error_to_status(exc: PipelineError) -> status_pb2.Status:
    """The status of one failed request; a `VersionNotHeld` names the held version in an `ErrorInfo`."""
    status = item_status(exc)
    if isinstance(exc, VersionNotHeld):
        info = error_details_pb2.ErrorInfo(
            reason=VERSION_NOT_HELD, domain=ERROR_DOMAIN, metadata={"weight_version": str(exc.held_version)}
        )
        detail = any_pb2.Any()
        detail.Pack(info)
        status.details.append(detail)
    return status


def request_error_from_status(status: status_pb2.Status) -> PipelineError:
    """The domain error of a failed request: `VersionNotHeld` when the status names a held version."""
    error = error_from_status(status)
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info) and info.reason == VERSION_NOT_HELD and info.domain == ERROR_DOMAIN:
            held = info.metadata.get("weight_version", "")
            if held.lstrip("-").isdigit():  # a peer that sends garbage gets the plain error
                return VersionNotHeld(error.message, int(held))
    return error


def capacity_to_proto(limits: Limits, info: ModelInfo, max_in_flight: int) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        capacity=pb.Capacity(
            max_in_flight=max_in_flight,
            max_new_tokens=limits.max_new_tokens,
            max_context=limits.max_context,
            model_info=model_info_to_proto(info),
            accepts_batches=True,
        )
    )


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        model=info.model,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        pad_token_id=info.pad_token_id,
        bos_token_id=info.bos_token_id,
        tokenizer=info.tokenizer,
        tokenizer_sha256=info.tokenizer_sha256,
    )


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model=msg.model,
        vocab_size=msg.vocab_size,
        eos_token_ids=tuple(msg.eos_token_ids),
        pad_token_id=msg.pad_token_id if msg.HasField("pad_token_id") else None,
        bos_token_id=msg.bos_token_id if msg.HasField("bos_token_id") else None,
        tokenizer=msg.tokenizer,
        tokenizer_sha256=msg.tokenizer_sha256,
    )


def completion_to_proto(c: Completion) -> pb.Completion:
    return pb.Completion(
        request_id=c.request_id,
        prompt_token_ids=c.prompt_token_ids,
        completion=convert.tokens_to_proto(c.tokens),
        text=c.text,
        finish_reason=convert.finish_reason_to_proto(c.finish_reason),
    )


def completion_from_proto(msg: pb.Completion) -> Completion:
    return Completion(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        tokens=convert.tokens_from_proto(msg.completion),
        text=msg.text,
        finish_reason=convert.finish_reason_from_proto(msg.finish_reason),
    )


def status_to_proto(s: InferenceStatus, max_running: int) -> pb.GetStatusResponse:
    return pb.GetStatusResponse(
        weight_version=convert.version_to_proto(s.weight_version),
        running=s.running,
        queued=s.queued,
        tokens_per_s=s.tokens_per_s,
        weight_updates=s.weight_updates,
        failed_weight_updates=s.failed_weight_updates,
        max_running=max_running,
        engine=s.engine,
        model=s.model_info.model,
        model_info=model_info_to_proto(s.model_info),
    )


def status_from_proto(msg: pb.GetStatusResponse) -> InferenceStatus:
    return InferenceStatus(
        weight_version=convert.version_from_proto(msg.weight_version),
        running=msg.running,
        queued=msg.queued,
        tokens_per_s=msg.tokens_per_s,
        weight_updates=msg.weight_updates,
        failed_weight_updates=msg.failed_weight_updates,
        engine=msg.engine,
        model_info=model_info_from_proto(msg.model_info),
    )
