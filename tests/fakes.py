"""Tiny in-memory cores for servicer and client tests: real behaviour, no models."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import UTC, datetime

from pipelinerl.common.errors import ErrorInfo, FailedPrecondition, InvalidArgument, NotFound
from pipelinerl.common.types import FinishReason, Sample, TokenSequence, WeightVersion
from pipelinerl.coordinator.types import (
    EvaluationResult,
    EvaluationSpec,
    Progress,
    RunInfo,
    RunSpec,
    RunState,
)
from pipelinerl.inference.types import GenerationRequest, GenerationUpdate, InferenceStatus, Limits, ModelInfo
from pipelinerl.reward.types import (
    ScoreItem,
    ScoreResult,
    ScorerStats,
    VerifierDetail,
    VerifierInfo,
    check_batch,
)
from pipelinerl.trainer.types import Disposition, Malformed, SampleAck, TrainerStatus
from pipelinerl.weights.types import (
    BucketSpec,
    Checksum,
    ChecksumAlgorithm,
    TensorSpec,
    WatchRequest,
    WeightChunk,
    WeightLayout,
    WeightNotice,
    crc32,
)


class FakeReward:
    """Exact-match reward; `delay_s` makes each batch slow (for shutdown tests)."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s

    async def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        check_batch(items)
        await asyncio.sleep(self.delay_s)
        results = []
        for item in items:
            score = float(item.completion.strip() == item.answer.strip())
            results.append(ScoreResult(item.sample_id, score, [VerifierDetail("exact", score, 1.0, "")]))
        return results

    def list_verifiers(self) -> list[VerifierInfo]:
        return [VerifierInfo("exact", "completion equals the answer")]

    @property
    def stats(self) -> ScorerStats:
        return ScorerStats(0, 0, 0, 0, 0, workers=1)


class FakeBackend:
    """Counts up from the last prompt token, one token per `step_s`, version 0."""

    limits = Limits(max_running=4, max_new_tokens=32, max_context=128)
    model_info = ModelInfo("counter", 100, (0,), None, None, "counter", "0" * 64)

    def __init__(self, step_s: float = 0.001) -> None:
        self.step_s = step_s
        self.aborted: list[str] = []
        self.running = 0
        self.peak_running = 0

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationUpdate]:
        if request.sampling.max_new_tokens > self.limits.max_new_tokens:
            raise InvalidArgument.field("sampling.max_new_tokens", f"over {self.limits.max_new_tokens}")
        last = request.prompt_token_ids[-1]
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            for i in range(request.sampling.max_new_tokens - 1):
                await asyncio.sleep(self.step_s)
                yield GenerationUpdate(request.request_id, TokenSequence([(last + i + 1) % 100], [-0.5], [0]))
            await asyncio.sleep(self.step_s)
            token = (last + request.sampling.max_new_tokens) % 100
            yield GenerationUpdate(
                request.request_id, TokenSequence([token], [-0.5], [0]), FinishReason.LENGTH, text="done"
            )
        except (asyncio.CancelledError, GeneratorExit):
            self.aborted.append(request.request_id)
            raise
        finally:
            self.running -= 1

    def status(self) -> InferenceStatus:
        return InferenceStatus(WeightVersion(0, "fake"), 0, 0, 0.0, 0, 0, "fake", self.model_info)


NO_LAG_BOUND = 2**31 - 1
"""The fake trainer's max_lag: the fake inference servers never take a new version."""


class FakeTrainer:
    """Accepts samples, 'trains' each batch at once (one version per batch), serves a one-bucket layout.
    Without checkpoints, every version is durable at once."""

    def __init__(self) -> None:
        self.version = 0
        self.max_lag = NO_LAG_BOUND
        self.trained: dict[str, int] = {}
        self.data = bytes(range(256)) * 64
        self._stepped = asyncio.Event()

    async def admit(self, entries: Sequence[Sample | Malformed], on_ack: Callable[[SampleAck], None]) -> None:
        for m in entries:
            if isinstance(m, Malformed):
                on_ack(
                    SampleAck(
                        m.sample_id, Disposition.REJECTED, self.version, ErrorInfo.from_exception(m.error)
                    )
                )
        samples = [s for s in entries if isinstance(s, Sample)]
        fresh = [s for s in samples if s.sample_id not in self.trained]
        for s in samples:
            if s.sample_id in self.trained:
                on_ack(SampleAck(s.sample_id, Disposition.DUPLICATE, self.trained[s.sample_id]))
        for s in fresh:
            on_ack(SampleAck(s.sample_id, Disposition.ACCEPTED, self.version))
        if fresh:
            await asyncio.sleep(0.01)
            self.version += 1
            for s in fresh:
                self.trained[s.sample_id] = self.version
                on_ack(SampleAck(s.sample_id, Disposition.TRAINED, self.version))
            self._stepped.set()

    async def flush(self, checkpoint: bool) -> None:
        """Every batch is trained at once: nothing is ever held."""

    @property
    def durable_version(self) -> int:
        return self.version

    async def wait_durable(self, after: int) -> int:
        while self.version <= after:
            self._stepped.clear()
            await self._stepped.wait()
        return self.version

    def _notice(self) -> WeightNotice:
        tensor = TensorSpec("w", (len(self.data) // 4,), "float32", 0, 0, len(self.data))
        bucket = BucketSpec(0, len(self.data), Checksum(ChecksumAlgorithm.CRC32, crc32(self.data)))
        return WeightNotice(WeightVersion(self.version, "fake"), WeightLayout((tensor,), (bucket,)))

    async def watch(self, receiver: WatchRequest) -> AsyncIterator[WeightNotice]:
        yield self._notice()

    async def fetch(self, version: WeightVersion, buckets: Sequence[int]) -> AsyncIterator[WeightChunk]:
        if version.version != self.version:
            raise FailedPrecondition(f"version {version.version} is gone; current is {self.version}")
        half = len(self.data) // 2
        for offset in (0, half):
            data = self.data[offset : offset + half]
            yield WeightChunk(version, 0, offset, data, Checksum(ChecksumAlgorithm.CRC32, crc32(data)))

    def status(self) -> TrainerStatus:
        version = WeightVersion(self.version, "fake")
        return TrainerStatus(version, 0, len(self.trained), 0, 0, 0.0, 0, self.version, self.max_lag)


class FakeCoordinator:
    def __init__(self) -> None:
        self.runs: dict[str, RunInfo] = {}
        self.evaluated: list[EvaluationSpec] = []

    async def start_run(self, run_id: str, spec: RunSpec) -> RunInfo:
        run = RunInfo(run_id, spec, RunState.RUNNING, Progress(), datetime(2026, 1, 1, tzinfo=UTC))
        return self.runs.setdefault(run_id, run)

    def get_run(self, run_id: str) -> RunInfo:
        if run_id not in self.runs:
            raise NotFound(f"no run {run_id!r}")
        return self.runs[run_id]

    async def stop_run(self, run_id: str) -> RunInfo:
        run = self.get_run(run_id)
        self.runs[run_id] = RunInfo(run.run_id, run.spec, RunState.STOPPED, run.progress, run.started_at)
        return self.runs[run_id]

    async def evaluate(self, spec: EvaluationSpec) -> EvaluationResult:
        """The same figures for any set: one problem at version 5."""
        self.evaluated.append(spec)
        finished = datetime(2026, 1, 1, tzinfo=UTC)
        k = spec.samples_per_problem
        return EvaluationResult(spec.dataset, 5, 1, k, 0.5, 0.5, 0.75, 3.0, 0.25, finished, 1.5, "fake:1")

    async def watch_run(self, run_id: str) -> AsyncIterator[RunInfo]:
        for trained in (1, 2):
            run = self.get_run(run_id)
            yield RunInfo(run.run_id, run.spec, run.state, Progress(trained=trained), run.started_at)
