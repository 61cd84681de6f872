"""One long-lived SubmitSamples stream to the trainer, shared by every group of a run, and the
journal's record of what the trainer did with each sample.

    send(samples) ──► stream ──► acks: TRAINED/DUPLICATE ──► journal `trained` (kept, resendable)
                                         other final      ──► journal `acked`
                        durable_version ≥ a kept sample's version ──► journal `acked` (final)

`send(samples)` gives a future per sample, done on its first final ack. A trained sample stays kept
until the trainer's `durable_version` covers its step; if its resend ends otherwise (the step was
lost with the trainer and the restarted one drops it for lag), `on_retracted` is told, so that
whoever counted it trained counts it again. If the stream breaks (the trainer
restarts), it is reopened and every sample not final, or trained but not durable, is sent again:
a trainer that still has it acks DUPLICATE, one restarted from an older checkpoint trains it
again, and no durable version counts for it until one of those answers. Either way its gradient
ends up in the trainer's checkpointed weights once. A flush that the broken stream carried is
sent again after them: a run whose groups all wait on the trainer sends no other, and a
restarted trainer holding a partial step would wait for samples that never come.

Each response is reported (`on_state`) as what the stream tells of the trainer: its newest version,
its version when the stream first answered, and whether resent samples are still unanswered. The
inference pool sends no prompt while they are (lag_gate.py), so a flush is sent after each response
until they are answered: the restarted trainer may hold the last of them as a partial step, which
no new sample would complete.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence

from pipelinerl.common.errors import PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import Sample
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.lag_gate import StreamState
from pipelinerl.trainer.client import Flush, TrainerClient
from pipelinerl.trainer.types import MAX_SAMPLES_PER_MESSAGE, Disposition, SampleAck

log = get_logger(__name__)

RECONNECT_S = 1.0
_TRAINED = (Disposition.TRAINED, Disposition.DUPLICATE)
_NOT_YET = 2**62  # the version of a kept sample resent, until the trainer answers for it

OnRetracted = Callable[[SampleAck], None]
"""Told of a sample acked trained whose resend then ended otherwise, with that final ack."""


class TrainerSubmitter:
    def __init__(
        self, trainer: TrainerClient, journal: Journal, on_state: Callable[[StreamState], None] | None = None
    ) -> None:
        self._trainer = trainer
        self._journal = journal
        self._on_state = on_state
        self._queue: asyncio.Queue[list[Sample] | Flush] = asyncio.Queue()
        self._waiting: dict[str, tuple[Sample, asyncio.Future[SampleAck]]] = {}
        self._kept: dict[str, tuple[Sample, int]] = {}
        """Trained, not yet durable: sample id -> (sample, version of its step)."""
        self._on_retracted: dict[str, OnRetracted] = {}
        """Waiting or kept: sample id -> whom to tell if it is acked trained, then final otherwise."""
        self._fresh: list[str] = []
        """Kept since the last response: the ones a durable version that did not move may cover."""
        self._answered = asyncio.Event()
        """Set on every response of the trainer (acks, a new durable version, or both)."""
        self._task: asyncio.Task[None] | None = None
        self._flushed: Flush | None = None
        """The last flush the current stream carried (a checkpoint asked for on it included)."""
        self._resent: set[str] = set()
        """Kept samples resent on the current stream that the trainer has not answered for yet."""
        self._resumed = -1
        """`latest_version` once the current stream first answered with acks; -1 before."""
        self.latest_version = 0
        self.durable_version = -1

    def start(self) -> None:
        self._task = asyncio.create_task(self._stream_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def send(
        self, samples: Sequence[Sample], on_retracted: OnRetracted | None = None
    ) -> dict[str, asyncio.Future[SampleAck]]:
        """Queue samples for the trainer; each future is done on the sample's first final ack."""
        loop = asyncio.get_running_loop()
        futures = {}
        for sample in samples:
            future: asyncio.Future[SampleAck] = loop.create_future()
            self._waiting[sample.sample_id] = (sample, future)
            futures[sample.sample_id] = future
            if on_retracted is not None:
                self._on_retracted[sample.sample_id] = on_retracted
        self._queue.put_nowait(list(samples))
        return futures

    def keep(self, trained: Sequence[Sample], on_retracted: OnRetracted | None = None) -> None:
        """Samples the journal holds as trained but not durable (a resumed run): resend them. As on
        every resend, no durable version counts for one until the trainer has answered for it."""
        for sample in trained:
            self._kept[sample.sample_id] = (sample, _NOT_YET)
            self._resent.add(sample.sample_id)
            if on_retracted is not None:
                self._on_retracted[sample.sample_id] = on_retracted
        self._queue_by_group(trained)
        self._report()

    def flush(self, checkpoint: bool = False) -> None:
        """Ask the trainer to train what it holds (nothing more is coming for now)."""
        self._queue.put_nowait(Flush(checkpoint))

    async def settle(self) -> None:
        """Flush and checkpoint, then return once every sample submitted is final and durable.
        Asked again after each answer: a checkpoint taken while the last step was still to come
        leaves that step's samples not durable, and the trainer checkpoints only when asked."""
        while self._waiting or self._kept:
            self._answered.clear()
            self.flush(checkpoint=True)
            await self._answered.wait()

    async def _batches(self) -> AsyncIterator[list[Sample] | Flush]:
        """What the stream carries: the groups queued while its last message was written, as one
        message. A flush taken from the queue counts as carried at once, so a stream that breaks
        before sending it sends it again (`_requeue`)."""
        self._flushed = None  # a new stream
        while True:
            items = _merged([await self._queue.get(), *_drained(self._queue)])
            for item in items:
                if isinstance(item, Flush):
                    checkpoint = item.checkpoint or (self._flushed is not None and self._flushed.checkpoint)
                    self._flushed = Flush(checkpoint)
            for item in items:
                yield self._flushed if isinstance(item, Flush) and self._flushed is not None else item

    async def _stream_forever(self) -> None:
        while True:
            try:
                async for acks, durable in self._trainer.submit_durably(self._batches()):
                    self._on_acks(acks)
                    self._on_durable(durable)
                    if acks and self._resumed < 0:
                        self._resumed = self.latest_version
                    if self._resent:
                        self.flush()
                    self._report()
            except PipelineError as exc:
                log.warning("trainer stream lost; resending what is not durable", error=exc.message)
            await asyncio.sleep(RECONNECT_S)
            self._requeue()

    def _on_acks(self, acks: Sequence[SampleAck]) -> None:
        """Journal a response's final acks in one transaction, then complete their futures (whose
        callers read the journal's state as written)."""
        trained: list[tuple[str, int]] = []
        final: list[tuple[str, str, int]] = []
        done: list[tuple[asyncio.Future[SampleAck], SampleAck]] = []
        retracted: list[tuple[OnRetracted, SampleAck]] = []
        for ack in acks:
            self.latest_version = max(self.latest_version, ack.version)
            if not ack.disposition.final:
                continue
            self._resent.discard(ack.sample_id)
            waiting = self._waiting.pop(ack.sample_id, None)
            kept = self._kept.pop(ack.sample_id, None)
            sample = waiting[0] if waiting else kept[0] if kept else None
            if sample is None:
                continue  # an ack of a resend whose outcome is known already
            if ack.disposition in _TRAINED:
                trained.append((ack.sample_id, ack.version))
                self._kept[ack.sample_id] = (sample, ack.version)
                self._fresh.append(ack.sample_id)
            else:
                final.append((ack.sample_id, ack.disposition.value, ack.version))
                on_retracted = self._on_retracted.pop(ack.sample_id, None)
                if kept is not None and on_retracted is not None:
                    retracted.append((on_retracted, ack))
            if waiting is not None and not waiting[1].done():
                done.append((waiting[1], ack))
        if trained or final:
            self._journal.mark_acks(trained, final)
        for future, ack in done:
            future.set_result(ack)
        for on_retracted, ack in retracted:
            on_retracted(ack)

    def _on_durable(self, durable: int) -> None:
        """Make final the kept samples a checkpoint now covers: all of them when the durable version
        moved, else only those kept since the last response (a scan of every kept sample on each
        response would cost a run quadratic time between checkpoints)."""
        moved = durable > self.durable_version
        self.durable_version = max(self.durable_version, durable)
        candidates = list(self._kept) if moved else self._fresh
        done = [
            sample_id
            for sample_id in candidates
            if (kept := self._kept.get(sample_id)) is not None and kept[1] <= self.durable_version
        ]
        self._fresh = []
        if done:
            self._journal.mark_durable(done)
            for sample_id in done:
                del self._kept[sample_id]
                self._on_retracted.pop(sample_id, None)
        self._answered.set()

    def _requeue(self) -> None:
        """Resend, by group, what is not final or not durable; then a flush, if one was queued or
        the broken stream carried one."""
        flushes = [self._flushed] if self._flushed is not None else []
        while not self._queue.empty():
            if isinstance(item := self._queue.get_nowait(), Flush):
                flushes.append(item)
        # No durable version covers a kept sample until the new stream's trainer has answered for
        # it: one restarted from an older checkpoint lost its step (and acks it ACCEPTED, then
        # TRAINED again); one that still has it acks DUPLICATE with its version.
        self._kept = {sample_id: (sample, _NOT_YET) for sample_id, (sample, _) in self._kept.items()}
        self._resent, self._resumed = set(self._kept), -1
        self._queue_by_group(
            [sample for sample, _ in self._waiting.values()] + [s for s, _ in self._kept.values()]
        )
        if flushes:
            self.flush(checkpoint=any(f.checkpoint for f in flushes))
        self._report()

    def _report(self) -> None:
        if self._on_state is not None:
            self._on_state(StreamState(self.latest_version, self._resumed, retraining=bool(self._resent)))

    def _queue_by_group(self, samples: Sequence[Sample]) -> None:
        for group in _by_group(samples).values():
            self._queue.put_nowait(_regrouped(group))


def _drained(queue: asyncio.Queue[list[Sample] | Flush]) -> list[list[Sample] | Flush]:
    items: list[list[Sample] | Flush] = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def _merged(items: Sequence[list[Sample] | Flush]) -> list[list[Sample] | Flush]:
    """Consecutive groups as one message, up to the trainer's limit; consecutive flushes as one."""
    merged: list[list[Sample] | Flush] = []
    for item in items:
        last = merged[-1] if merged else None
        if isinstance(item, Flush) and isinstance(last, Flush):
            merged[-1] = Flush(last.checkpoint or item.checkpoint)
        elif (
            isinstance(item, list)
            and isinstance(last, list)
            and len(last) + len(item) <= MAX_SAMPLES_PER_MESSAGE
        ):
            merged[-1] = last + item
        else:
            merged.append(item)
    return merged


def _by_group(samples: Sequence[Sample]) -> dict[str, list[Sample]]:
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    return groups


def _regrouped(group: Sequence[Sample]) -> list[Sample]:
    """The samples of one group, each naming the group's size as sent now: a group resent in
    part must still be complete at the trainer."""
    return [dataclasses.replace(sample, group_size=len(group)) for sample in group]
