"""Inference messages <-> inference domain types, both directions (servicer and client)."""

from __future__ import annotations

from pipelinerl.common import convert
from pipelinerl.inference.types import Completion, InferenceStatus, Limits, ModelInfo
from pipelinerl.inference.v1 import inference_pb2 as pb


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
