"""The coordinator's trainer stream settles a run: once every sample is trained, it asks for
checkpoints until one holds them all, even when the first one asked for lands before the last step;
a flush lost with a broken stream is sent again after the resend; and what is queued while the
stream is busy leaves in as few messages as the trainer's limit allows."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from pathlib import Path

import pytest

from pipelinerl.common.errors import Unavailable
from pipelinerl.common.types import Sample, TokenSequence
from pipelinerl.coordinator import submitter as submitter_module
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.lag_gate import StreamState
from pipelinerl.coordinator.submitter import TrainerSubmitter
from pipelinerl.trainer.client import Flush
from pipelinerl.trainer.types import Disposition, SampleAck


class LateStepTrainer:
    """Buffers samples; on a flush with a checkpoint, checkpoints what is trained so far and only
    then takes the step that was due (a checkpoint asked for while a step is under way)."""

    def __init__(self) -> None:
        self.checkpoints: list[int] = []

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        version, buffered = 0, []
        async for item in batches:
            if not isinstance(item, Flush):
                buffered += item
                yield [SampleAck(s.sample_id, Disposition.ACCEPTED, version) for s in item], self.durable
                continue
            if item.checkpoint and (not self.checkpoints or self.checkpoints[-1] != version):
                self.checkpoints.append(version)
            acks = []
            if buffered:
                version += 1
                acks = [SampleAck(s.sample_id, Disposition.TRAINED, version) for s in buffered]
                buffered = []
            yield acks, self.durable

    @property
    def durable(self) -> int:
        return self.checkpoints[-1] if self.checkpoints else -1


SAMPLE = Sample("s0", "g0", [1, 2], TokenSequence([3], [-0.5], [0]), 1.0)


@contextlib.asynccontextmanager
async def submitting(trainer: object, tmp_path: Path) -> AsyncIterator[TrainerSubmitter]:
    """A started submitter streaming to `trainer` (a stand-in: the stream is all it uses), on a
    journal in `tmp_path`; closed after."""
    journal = Journal(tmp_path / "journal.sqlite")
    submitter = TrainerSubmitter(trainer, journal)  # type: ignore[arg-type]
    submitter.start()
    try:
        yield submitter
    finally:
        await submitter.close()
        journal.close()


async def test_settle_asks_again_until_a_checkpoint_holds_the_last_step(tmp_path: Path) -> None:
    trainer = LateStepTrainer()
    async with submitting(trainer, tmp_path) as submitter:
        submitter.send([SAMPLE])
        await asyncio.wait_for(submitter.settle(), timeout=5)
    assert trainer.checkpoints == [0, 1]  # the first came before the step, the second holds it
    assert submitter.durable_version == 1


class RestartingTrainer:
    """Trains only on a flush. Its first stream breaks as soon as it has received a flush, with
    what it buffered untrained (a trainer killed before the step); later streams are well."""

    def __init__(self) -> None:
        self.streams = 0

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        self.streams += 1
        buffered: list[Sample] = []
        async for item in batches:
            if not isinstance(item, Flush):
                buffered += item
                yield [SampleAck(s.sample_id, Disposition.ACCEPTED, 0) for s in item], -1
            elif self.streams == 1:
                raise Unavailable("the trainer was killed")
            else:
                yield [SampleAck(s.sample_id, Disposition.TRAINED, 1) for s in buffered], -1
                buffered = []


async def test_a_flush_lost_with_its_stream_is_sent_again_after_the_resend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's only flush went down with the stream: the samples resent to the restarted trainer
    would wait for a step that nothing asks for (a run whose groups all wait on the trainer
    dispatches nothing more, so it sends no other flush)."""
    monkeypatch.setattr(submitter_module, "RECONNECT_S", 0.01)
    trainer = RestartingTrainer()
    async with submitting(trainer, tmp_path) as submitter:
        [future] = submitter.send([SAMPLE]).values()
        submitter.flush()
        ack = await asyncio.wait_for(future, timeout=5)
    assert ack.disposition is Disposition.TRAINED and trainer.streams == 2


class RecordingTrainer:
    """Keeps every message of its stream; trains each batch of samples at once."""

    def __init__(self) -> None:
        self.messages: list[list[str] | Flush] = []

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        async for item in batches:
            if isinstance(item, Flush):
                self.messages.append(item)
                continue
            self.messages.append([s.sample_id for s in item])
            yield [SampleAck(s.sample_id, Disposition.TRAINED, 1) for s in item], -1


def group_of(group_id: str, size: int) -> list[Sample]:
    return [dataclasses.replace(SAMPLE, sample_id=f"{group_id}-a{i}", group_id=group_id, group_size=size)
            for i in range(size)]  # fmt: skip


async def test_groups_queued_in_one_turn_leave_as_one_message_up_to_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three groups and two flushes submitted while the stream was busy leave as the first two
    groups (the trainer's limit of 5 samples per message leaves the third out), the third, and one
    flush that asks for the checkpoint either asked for; a group sent after them goes alone."""
    monkeypatch.setattr(submitter_module, "MAX_SAMPLES_PER_MESSAGE", 5)
    trainer = RecordingTrainer()
    async with submitting(trainer, tmp_path) as submitter:
        futures = {}
        for group_id, size in (("g0", 2), ("g1", 3), ("g2", 2)):
            futures |= submitter.send(group_of(group_id, size))
        submitter.flush(checkpoint=True)
        submitter.flush()
        await asyncio.wait_for(asyncio.gather(*futures.values()), timeout=5)
        await asyncio.wait_for(asyncio.gather(*submitter.send(group_of("g3", 2)).values()), timeout=5)
    assert trainer.messages == [
        ["g0-a0", "g0-a1", "g1-a0", "g1-a1", "g1-a2"],
        ["g2-a0", "g2-a1"],
        Flush(checkpoint=True),
        ["g3-a0", "g3-a1"],
    ]


class LostStepTrainer:
    """The first stream trains the sample as version 5, then dies with that step (its checkpoint
    is older). The restarted trainer reports a durable version of 6 before it reads anything (its
    resumed weights, checkpointed as 6), then trains the resent sample again as version 7."""

    def __init__(self) -> None:
        self.streams = 0
        self.retrained = False

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        self.streams += 1
        if self.streams > 1:
            yield [], 6
        buffered: list[Sample] = []
        async for item in batches:
            if self.streams == 1:
                if isinstance(item, Flush):
                    raise Unavailable("the trainer was killed")
                yield [SampleAck(s.sample_id, Disposition.TRAINED, 5) for s in item], -1
            elif not isinstance(item, Flush):
                buffered += item
                yield [SampleAck(s.sample_id, Disposition.ACCEPTED, 6) for s in item], 6
            else:
                self.retrained = self.retrained or bool(buffered)
                yield [SampleAck(s.sample_id, Disposition.TRAINED, 7) for s in buffered], 7
                buffered = []


async def test_a_sample_whose_step_died_with_the_trainer_is_durable_only_once_trained_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted trainer's durable version can pass the version of a lost step before the resend
    reaches it: that version does not hold the sample, so the journal must not call it final."""
    monkeypatch.setattr(submitter_module, "RECONNECT_S", 0.01)
    trainer = LostStepTrainer()
    marked: list[tuple[list[str], bool]] = []
    journal = Journal(tmp_path / "journal.sqlite")
    monkeypatch.setattr(journal, "mark_durable", lambda ids: marked.append((list(ids), trainer.retrained)))
    submitter = TrainerSubmitter(trainer, journal)  # type: ignore[arg-type]
    submitter.start()
    try:
        [future] = submitter.send([SAMPLE]).values()
        assert (await asyncio.wait_for(future, timeout=5)).version == 5
        await asyncio.wait_for(submitter.settle(), timeout=5)
    finally:
        await submitter.close()
        journal.close()
    assert marked == [(["s0"], True)]  # once, after the step that holds it again


class LostThenDroppedTrainer:
    """The first stream trains the sample as version 5 and dies with that step; the restarted
    trainer drops the resent sample for lag."""

    def __init__(self) -> None:
        self.streams = 0

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        self.streams += 1
        async for item in batches:
            if isinstance(item, Flush):
                if self.streams == 1:
                    raise Unavailable("the trainer was killed")
                continue
            disposition = Disposition.TRAINED if self.streams == 1 else Disposition.DROPPED
            yield [SampleAck(s.sample_id, disposition, 5) for s in item], -1


async def test_a_trained_sample_whose_step_died_and_whose_resend_was_dropped_is_retracted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run counted it trained on its first ack; the journal ends it dropped, and the run's
    counts must follow (a chaos soak's run reported 1,280 samples trained that its weights lack)."""
    monkeypatch.setattr(submitter_module, "RECONNECT_S", 0.01)
    retracted: list[SampleAck] = []
    async with submitting(LostThenDroppedTrainer(), tmp_path) as submitter:
        [future] = submitter.send([SAMPLE], retracted.append).values()
        assert (await asyncio.wait_for(future, timeout=5)).disposition is Disposition.TRAINED
        submitter.flush()
        await asyncio.wait_for(submitter.settle(), timeout=5)
    assert [ack.disposition for ack in retracted] == [Disposition.DROPPED]


class ReplayingTrainer:
    """The first stream trains each batch at once (version 1) and breaks on the next. The restarted
    trainer resumes at version 5 and, like a real one holding less than a step, trains what it holds
    only on a flush (version 6)."""

    def __init__(self) -> None:
        self.streams = 0

    async def submit_durably(
        self, batches: AsyncIterable[Sequence[Sample] | Flush]
    ) -> AsyncIterator[tuple[list[SampleAck], int]]:
        self.streams += 1
        buffered: list[Sample] = []
        async for item in batches:
            if self.streams == 1:
                if buffered:
                    raise Unavailable("the trainer was killed")
                buffered = list(item) if not isinstance(item, Flush) else []
                yield [SampleAck(s.sample_id, Disposition.TRAINED, 1) for s in buffered], -1
            elif not isinstance(item, Flush):
                buffered += item
                yield [SampleAck(s.sample_id, Disposition.ACCEPTED, 5) for s in item], -1
            elif buffered:
                yield [SampleAck(s.sample_id, Disposition.TRAINED, 6) for s in buffered], -1
                buffered = []


async def test_after_a_restart_the_stream_reports_the_replay_and_flushes_until_it_is_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inference pool sends no prompt while resent samples are unanswered, so no new sample
    would complete a partial step of them: the submitter asks for flushes until they are answered."""
    monkeypatch.setattr(submitter_module, "RECONNECT_S", 0.01)
    states: list[StreamState] = []
    journal = Journal(tmp_path / "journal.sqlite")
    submitter = TrainerSubmitter(ReplayingTrainer(), journal, on_state=states.append)  # type: ignore[arg-type]
    submitter.start()
    try:
        await asyncio.wait_for(asyncio.gather(*submitter.send([SAMPLE]).values()), timeout=5)
        later = dataclasses.replace(SAMPLE, sample_id="s1", group_id="g1")
        [ack] = await asyncio.wait_for(asyncio.gather(*submitter.send([later]).values()), timeout=5)
    finally:
        await submitter.close()
        journal.close()
    assert ack == SampleAck("s1", Disposition.TRAINED, 6)
    assert states[0] == StreamState(1, 1, retraining=False)
    assert StreamState(1, -1, retraining=True) in states  # the stream broke: s0 is resent
    assert StreamState(5, 5, retraining=True) in states  # the restarted trainer holds it
    assert states[-1] == StreamState(6, 5, retraining=False)
