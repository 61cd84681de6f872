"""One long-lived SubmitSamples stream to the trainer, shared by every group of a run.

`submit(samples)` returns once every sample has its final ack. If the stream breaks (the trainer
restarts), it is reopened and every sample still waiting is sent again: the trainer acks an id
it has already trained on as DUPLICATE, so resending is always safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from pipelinerl.common.errors import PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import Sample
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.types import SampleAck

log = get_logger(__name__)

RECONNECT_S = 1.0


class TrainerSubmitter:
    def __init__(self, trainer: TrainerClient) -> None:
        self._trainer = trainer
        self._queue: asyncio.Queue[list[Sample]] = asyncio.Queue()
        self._waiting: dict[str, tuple[Sample, asyncio.Future[SampleAck]]] = {}
        self._task: asyncio.Task[None] | None = None
        self.latest_version = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._stream_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def submit(self, samples: Sequence[Sample]) -> dict[str, SampleAck]:
        loop = asyncio.get_running_loop()
        futures = {}
        for sample in samples:
            future: asyncio.Future[SampleAck] = loop.create_future()
            self._waiting[sample.sample_id] = (sample, future)
            futures[sample.sample_id] = future
        self._queue.put_nowait(list(samples))
        return {sample_id: await future for sample_id, future in futures.items()}

    async def _batches(self) -> AsyncIterator[list[Sample]]:
        while True:
            yield await self._queue.get()

    async def _stream_forever(self) -> None:
        while True:
            try:
                async for ack in self._trainer.submit(self._batches()):
                    self._on_ack(ack)
            except PipelineError as exc:
                log.warning("trainer stream lost; resending what is unacknowledged", error=exc.message)
            await asyncio.sleep(RECONNECT_S)
            self._requeue_waiting()

    def _on_ack(self, ack: SampleAck) -> None:
        self.latest_version = max(self.latest_version, ack.version)
        if not ack.disposition.final:
            return
        entry = self._waiting.pop(ack.sample_id, None)
        if entry is not None and not entry[1].done():
            entry[1].set_result(ack)

    def _requeue_waiting(self) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
        by_group: dict[str, list[Sample]] = {}
        for sample, _ in self._waiting.values():
            by_group.setdefault(sample.group_id, []).append(sample)
        for group in by_group.values():
            self._queue.put_nowait(group)
