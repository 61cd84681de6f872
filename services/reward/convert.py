"""Reward messages <-> reward domain types, both directions (servicer and client)."""

from __future__ import annotations

from dataclasses import asdict, fields

from pipelinerl.common.status import info_from_status, ok_status, status_proto
from pipelinerl.reward.types import ScoreItem, ScoreResult, ScorerStats, VerifierDetail, VerifierInfo
from pipelinerl.reward.v1 import reward_pb2 as pb


def item_to_proto(item: ScoreItem) -> pb.ScoreItem:
    return pb.ScoreItem(
        sample_id=item.sample_id,
        prompt=item.prompt,
        completion=item.completion,
        answer=item.answer,
        verifier=item.verifier,
    )


def item_from_proto(msg: pb.ScoreItem) -> ScoreItem:
    return ScoreItem(msg.sample_id, msg.prompt, msg.completion, msg.answer, msg.verifier)


def result_to_proto(result: ScoreResult) -> pb.ScoreResult:
    return pb.ScoreResult(
        sample_id=result.sample_id,
        reward=result.reward or 0.0,
        details=[
            pb.VerifierDetail(verifier=d.verifier, score=d.score, weight=d.weight, message=d.message)
            for d in result.details
        ],
        status=ok_status() if result.error is None else status_proto(result.error),
    )


def result_from_proto(msg: pb.ScoreResult) -> ScoreResult:
    error = info_from_status(msg.status)
    return ScoreResult(
        sample_id=msg.sample_id,
        reward=None if error is not None else msg.reward,
        details=[VerifierDetail(d.verifier, d.score, d.weight, d.message) for d in msg.details],
        error=error,
    )


def verifier_to_proto(info: VerifierInfo) -> pb.VerifierInfo:
    return pb.VerifierInfo(name=info.name, description=info.description)


def verifier_from_proto(msg: pb.VerifierInfo) -> VerifierInfo:
    return VerifierInfo(msg.name, msg.description)


def stats_to_proto(stats: ScorerStats) -> pb.GetStatusResponse:
    return pb.GetStatusResponse(**asdict(stats))


def stats_from_proto(msg: pb.GetStatusResponse) -> ScorerStats:
    return ScorerStats(**{f.name: getattr(msg, f.name) for f in fields(ScorerStats)})
