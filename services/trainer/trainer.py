"""The trainer core: admission, the training loop and weight publishing, behind `TrainerCore`.

    SubmitSamples ──admit──► duplicate? ──► DUPLICATE
                              beyond the learner's limits (validation.py), or a future version?
                                  ──► REJECTED (INVALID_ARGUMENT naming the field)
                              lag > max_lag? ──► DROPPED (policy drop) / kept (reweight, wait)
                              └─► ACCEPTED ──► group buffer ── group complete ──► ready groups
    training loop: ready ≥ samples_per_step (policy wait: and fresh data seen, see LagPolicy.WAIT)
                   ──► learner.step (thread) ──► version + 1
                         raised? ──► each half of the groups as a step of its own: a group that fails
                                     alone is REJECTED; MAX_FAILED_GROUPS in a row ──► NOT_SERVING
                   ──► publisher.publish ──► TRAINED acks ──► metrics line, Prometheus, TensorBoard/W&B
                   ──► checkpoint every N

Samples arrive by group and are trained by whole groups, since advantages are relative to the
group. A sample dropped for lag or rejected still counts toward its group being complete, so a
group is never held back forever by one bad member. Ids already trained on are remembered (and checkpointed),
so a coordinator may resend after a crash without anything being trained twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from pipelinerl.common.errors import ErrorInfo, InvalidArgument, Unavailable
from pipelinerl.common.log import bind_context, get_logger
from pipelinerl.common.types import Sample, WeightVersion
from pipelinerl.trainer.checkpoint import CheckpointDir
from pipelinerl.trainer.config import LagPolicy, TrainerSettings
from pipelinerl.trainer.learner import Learner, StepMetrics
from pipelinerl.trainer.lineage import lineage_lag
from pipelinerl.trainer.metrics import TrainerMetrics
from pipelinerl.trainer.tracking import StepLogs
from pipelinerl.trainer.types import Disposition, Malformed, SampleAck, TrainerStatus
from pipelinerl.trainer.validation import check_sample
from pipelinerl.weights.publisher import WeightPublisher
from pipelinerl.weights.types import WatchRequest, WeightChunk, WeightNotice

log = get_logger(__name__)

AckSink = Callable[[SampleAck], None]

MAX_FAILED_GROUPS = 3
"""Groups in a row that fail a step on their own, with no step succeeding between them, before the
trainer stops: by then the learner, not the data, is failing."""


@dataclass
class _Group:
    size: int
    arrived: set[str] = field(default_factory=set)
    """Ids of members seen, trained or not, so a resent one does not count twice."""
    samples: list[Sample] = field(default_factory=list)


class Trainer:
    """Implements `TrainerCore` over a `Learner` and a `WeightPublisher`."""

    def __init__(
        self,
        learner: Learner,
        publisher: WeightPublisher,
        settings: TrainerSettings,
        on_halt: Callable[[str], Awaitable[None]] | None = None,
        metrics: TrainerMetrics | None = None,
        step_logs: StepLogs | None = None,
    ) -> None:
        """`settings` give the step size, lag policy, buffer, checkpoints and metrics file (the
        learner and publisher have taken theirs). `on_halt(reason)` is awaited if training stops
        for good (e.g. to report NOT_SERVING). `metrics` count acks and steps for Prometheus;
        `step_logs` receive every step's metrics line (TensorBoard, W&B)."""
        self.learner = learner
        self.publisher = publisher
        self.settings = settings
        self.metrics = metrics or TrainerMetrics(CollectorRegistry())
        self._step_logs = step_logs or StepLogs()
        self.version = 0
        self.trained_ids: dict[str, int] = {}
        """Every sample id trained on (checkpointed with the weights) -> the version its step produced."""
        self._checkpoints = (
            None if settings.checkpoint_dir is None else CheckpointDir(settings.checkpoint_dir)
        )
        self._groups: dict[str, _Group] = {}
        self._held: dict[str, AckSink] = {}
        """Accepted, not yet trained: sample id -> where its final ack goes (the latest stream that
        sent it, so a coordinator that reconnected and resent it hears the outcome)."""
        self._ready: list[_Group] = []
        self._buffered = 0
        self._counts = {"dropped": 0, "rejected": 0}
        self._freshest = -1
        """Newest token version of any admitted sample: how far generation has caught up."""
        self._lost: list[tuple[int, int]] = []
        """(first lost, resumed) per restart: versions first..resumed-1 died with a crash and
        `resumed` republished the weights of first - 1, so none of them is a step."""
        self._tokens_per_s = 0.0
        self._changed = asyncio.Condition()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._flushing = False
        self._stepping = False
        self._checkpoint_wanted = False
        self._checkpointed = 0
        self._on_halt = on_halt
        self._failed_groups = 0
        """Groups in a row rejected because a step failed on them alone; 0 after a step succeeds."""

    async def start(self) -> None:
        """Resume from the latest checkpoint if there is one (`CheckpointDir.resume`), publish the
        current version, train."""
        if self._checkpoints is not None:
            resumed = await asyncio.to_thread(self._checkpoints.resume, self.learner)
            self.version, self._checkpointed = resumed.version, resumed.checkpointed
            self.trained_ids, self._lost = resumed.trained_ids, resumed.lost
            if resumed.checkpoint is not None or resumed.published >= 0:
                log.info("resumed", checkpoint=str(resumed.checkpoint), version=self.version,
                         durable_version=self._checkpointed, trained_ids=len(self.trained_ids))  # fmt: skip
        bind_context(version=self.version)
        await self._publish()
        self._loop_task = asyncio.create_task(self._train_or_halt())

    async def close(self) -> None:
        """Let a step in progress finish (its acks are out already), then checkpoint and stop."""
        async with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._loop_task is not None:
            await asyncio.gather(self._loop_task, return_exceptions=True)
        if self._checkpointed != self.version:
            await self._checkpoint()
        self._step_logs.close()
        async with self._changed:
            self._changed.notify_all()  # wakes `wait_durable`

    # ---- TrainerCore --------------------------------------------------------------------------

    async def admit(self, samples: Sequence[Sample | Malformed], on_ack: AckSink) -> None:
        async with self._changed:
            # Backpressure: stop reading the stream while the buffer is full.
            await self._changed.wait_for(lambda: self._buffered < self.settings.max_buffered_samples)
            for index, sample in enumerate(samples):
                self._admit_one(index, sample, self._observed(on_ack, sample))
            self._changed.notify_all()

    async def flush(self, checkpoint: bool) -> None:
        async with self._changed:
            # A step under way or due frees the client's slots by itself, and a client still stalled
            # after it asks again; a partial step now would only add a version of lag.
            due = self._stepping or self._ready_samples() >= self.settings.samples_per_step
            self._flushing = bool(self._ready) and not due
            self._checkpoint_wanted = self._checkpoint_wanted or checkpoint
            self._changed.notify_all()

    @property
    def durable_version(self) -> int:
        """Every TRAINED ack of a version up to this one survives a crash (its step is in a
        checkpoint). Without a checkpoint folder nothing can be resumed, so every step counts."""
        return self.version if self._checkpoints is None else self._checkpointed

    async def wait_durable(self, after: int) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: self._stopping or self.durable_version > after)
            return self.durable_version

    def watch(self, receiver: WatchRequest) -> AsyncIterator[WeightNotice]:
        return self.publisher.watch(receiver)

    def fetch(self, version: WeightVersion, buckets: Sequence[int]) -> AsyncIterator[WeightChunk]:
        return self.publisher.fetch(version, buckets)

    def release(self, receiver_id: str, version: WeightVersion) -> None:
        self.publisher.release(receiver_id, version)

    def status(self) -> TrainerStatus:
        # The version published, not a step's that is still being published: clients fetch it.
        return TrainerStatus(
            version=self.publisher.latest or WeightVersion(self.version, self.publisher.run_id),
            buffered_samples=self._buffered,
            trained_samples=len(self.trained_ids),
            durable_version=self.durable_version,
            dropped_samples=self._counts["dropped"],
            rejected_samples=self._counts["rejected"],
            tokens_per_s=self._tokens_per_s,
            watchers=self.publisher.watchers,
            max_lag=self.settings.max_lag,
        )

    def lag(self, token_version: int, version: int) -> int:
        return lineage_lag(token_version, version, self._lost)

    # ---- admission ----------------------------------------------------------------------------

    def _observed(self, on_ack: AckSink, sample: Sample | Malformed) -> AckSink:
        """`on_ack`, with every ack of `sample` (now and later) counted, and the final one logged
        with its ids (ACCEPTED only says that a final ack will follow)."""

        def observed(ack: SampleAck) -> None:
            self.metrics.acked(ack.disposition)
            if ack.disposition is not Disposition.ACCEPTED:  # a refused sample is news at any level
                emit = log.warning if ack.disposition is Disposition.REJECTED else log.debug
                emit("sample acked", sample_id=ack.sample_id, group_id=sample.group_id,
                     disposition=ack.disposition.value, version=ack.version)  # fmt: skip
            on_ack(ack)

        return observed

    def _admit_one(self, index: int, sample: Sample | Malformed, on_ack: AckSink) -> None:
        if sample.sample_id in self.trained_ids:
            on_ack(SampleAck(sample.sample_id, Disposition.DUPLICATE, self.trained_ids[sample.sample_id]))
            return
        if sample.sample_id in self._held:  # resent while buffered or in a step: not admitted twice
            self._held[sample.sample_id] = on_ack
            on_ack(SampleAck(sample.sample_id, Disposition.ACCEPTED, self.version))
            return
        if self._loop_task is not None and self._loop_task.done():
            raise Unavailable("the training loop has stopped")
        # Rejected and dropped samples count toward their group too, so the others are not held forever.
        group = self._groups.setdefault(sample.group_id, _Group(sample.group_size))
        group.arrived.add(sample.sample_id)
        try:
            if isinstance(sample, Malformed):
                raise sample.error
            check_sample(sample, self.learner.limits, f"samples[{index}]")
            if max(sample.completion.versions) > self.version:
                raise InvalidArgument.field(
                    f"samples[{index}].completion.versions",
                    f"version {max(sample.completion.versions)} is newer than the trainer's {self.version}",
                )
        except InvalidArgument as error:
            self._counts["rejected"] += 1
            on_ack(
                SampleAck(
                    sample.sample_id, Disposition.REJECTED, self.version, ErrorInfo.from_exception(error)
                )
            )
        else:
            self._hold(group, sample, on_ack)
        if len(group.arrived) >= group.size:
            del self._groups[sample.group_id]
            if group.samples:
                self._ready.append(group)

    def _hold(self, group: _Group, sample: Sample, on_ack: AckSink) -> None:
        """A valid sample: dropped for lag, or buffered in its group until a step trains it."""
        self._freshest = max(self._freshest, max(sample.completion.versions))
        # Versions are the model tokens' only, so a multi-turn sample is judged at its oldest turn.
        lag = self.lag(min(sample.completion.versions), self.version)
        if lag > self.settings.max_lag and self.settings.lag_policy is LagPolicy.DROP:
            self._counts["dropped"] += 1
            on_ack(SampleAck(sample.sample_id, Disposition.DROPPED, self.version))
        else:
            group.samples.append(sample)
            self._held[sample.sample_id] = on_ack
            self._buffered += 1
            on_ack(SampleAck(sample.sample_id, Disposition.ACCEPTED, self.version))

    # ---- training -----------------------------------------------------------------------------

    def _ready_samples(self) -> int:
        return sum(len(g.samples) for g in self._ready)

    def _generation_caught_up(self) -> bool:
        """Policy wait: may the trainer take the step to version + 1? (Always, for other policies.)"""
        if self.settings.lag_policy is not LagPolicy.WAIT:
            return True
        if self.lag(self._freshest, self.version + 1) <= self.settings.max_lag:
            return True
        if self._buffered >= self.settings.max_buffered_samples:
            log.warning(
                "lag policy wait: buffer full of stale samples, stepping anyway", freshest=self._freshest
            )
            return True
        return False

    async def _train_or_halt(self) -> None:
        """The training loop. Should it fail, no step follows: health turns NOT_SERVING (`on_halt`)
        and admission answers UNAVAILABLE, instead of accepting samples that will never train."""
        try:
            await self._train_forever()
        except Exception as error:
            log.error("training loop failed; no further steps", exc_info=error)
            if self._on_halt is not None:
                await self._on_halt(f"training loop failed: {error!r}")
            raise

    async def _train_forever(self) -> None:
        while True:
            idle_since = time.perf_counter()
            async with self._changed:
                await self._changed.wait_for(
                    lambda: (
                        self._stopping
                        or (self._flushing and bool(self._ready))
                        or (self._checkpoint_wanted and not self._flushing)
                        or (
                            self._ready_samples() >= self.settings.samples_per_step
                            and self._generation_caught_up()
                        )
                    )
                )
                if self._stopping:
                    return
                batch: list[_Group] = []
                while self._ready and sum(len(g.samples) for g in batch) < self.settings.samples_per_step:
                    batch.append(self._ready.pop(0))
                self._stepping = bool(batch)
            if batch:
                try:
                    await self._train(batch, wait_s=time.perf_counter() - idle_since)
                finally:
                    self._stepping = False
            if not self._ready:
                self._flushing = False
            if self._checkpoint_wanted and not self._flushing:
                self._checkpoint_wanted = False
                if self._checkpointed != self.version:
                    await self._checkpoint()

    async def _train(self, groups: list[_Group], wait_s: float) -> None:
        samples = [sample for group in groups for sample in group.samples]
        started = time.perf_counter()
        try:
            metrics = await asyncio.to_thread(self.learner.step, samples, self.version, self._lost)
        except Exception as error:
            await self._step_failed(groups, error, wait_s)
            return
        self._failed_groups = 0
        if metrics.stepped:
            self.version += 1
            bind_context(version=self.version)
            publish_started = time.perf_counter()
            await self._publish()
            publish_s = time.perf_counter() - publish_started
        else:
            publish_s = 0.0
        disposition = Disposition.TRAINED if metrics.stepped else Disposition.DROPPED
        for sample in samples:
            if metrics.stepped:
                self.trained_ids[sample.sample_id] = self.version
            self._held.pop(sample.sample_id)(SampleAck(sample.sample_id, disposition, self.version))
        # The step is over for the client: it may answer these acks with a flush at once, while the
        # checkpoint below is written, and would not ask again (`flush` ignores a step under way).
        self._stepping = False
        async with self._changed:
            self._buffered -= len(samples)
            self._changed.notify_all()
        self._tokens_per_s = metrics.tokens_per_s
        self._record(metrics, wait_s, publish_s, time.perf_counter() - started)
        if metrics.stepped and self.version % self.settings.checkpoint_every == 0:
            await self._checkpoint()

    async def _step_failed(self, groups: list[_Group], error: Exception, wait_s: float) -> None:
        """A step raised, before changing the weights: train each half of its groups as a step of its
        own, which narrows the failure down to the groups that fail alone. Those are rejected (with
        the error) and the rest trains; `MAX_FAILED_GROUPS` in a row stop the loop."""
        samples = [sample for group in groups for sample in group.samples]
        log.error("step failed", groups=len(groups), samples=len(samples), exc_info=error)
        if len(groups) > 1:
            half = len(groups) // 2
            for part in (groups[:half], groups[half:]):
                await self._train(part, wait_s)
            return
        reason = ErrorInfo("INTERNAL", f"a training step failed on this sample's group: {error!r}")
        log.error("group rejected: the step fails on it", group=samples[0].group_id, samples=len(samples))
        for sample in samples:
            self._held.pop(sample.sample_id)(
                SampleAck(sample.sample_id, Disposition.REJECTED, self.version, reason)
            )
        self._counts["rejected"] += len(samples)
        async with self._changed:
            self._buffered -= len(samples)
            self._changed.notify_all()
        self._failed_groups += 1
        if self._failed_groups >= MAX_FAILED_GROUPS:
            raise RuntimeError(f"{self._failed_groups} groups in a row failed a step on their own") from error

    def _record(self, metrics: StepMetrics, wait_s: float, publish_s: float, step_s: float) -> None:
        line = {
            "version": self.version,
            "wait_s": wait_s,
            "publish_s": publish_s,
            "step_s": step_s,
            **dataclasses.asdict(metrics),
        }
        line["lag_histogram"] = {str(k): v for k, v in metrics.lag_histogram.items()}
        log.info("step", version=self.version, reward=round(metrics.reward_mean, 4), samples=metrics.samples,
                 loss=round(metrics.loss, 5), seconds=round(step_s, 3))  # fmt: skip
        self.metrics.stepped(metrics, wait_s, publish_s, step_s)
        self._step_logs.log(self.version, line)
        if self.settings.metrics_file is not None:
            with self.settings.metrics_file.open("a") as f:
                f.write(json.dumps(line) + "\n")

    async def _publish(self) -> None:
        if self._checkpoints is not None:
            await asyncio.to_thread(self._checkpoints.record_published, self.version)
        await self.publisher.publish(self.version, self.learner.weights_for_publish())

    async def _checkpoint(self) -> None:
        if self._checkpoints is None:
            self._checkpointed = self.version
            return
        await asyncio.to_thread(
            self._checkpoints.save, self.learner, self.version, self.trained_ids, self._lost
        )
        async with self._changed:
            self._checkpointed = self.version
            self._changed.notify_all()
