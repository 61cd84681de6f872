"""When a run evaluates its held-out sets: at its first weight version, every `every_versions`
versions, and at its last.

    trainer version ─► due? (per set: never evaluated, or a multiple of N past its last evaluation)
                   ─► Evaluator.evaluate (evaluation.py) ─► journal, whole ─► RunInfo.evaluations

Evaluations run one at a time beside training, in a task of the run; training never waits for
them. A set is due at version `(last // N + 1) * N`; the evaluation is attributed to the version a
server holds when it starts, that one or newer. The journal holds each finished evaluation, so a
restarted run reports them and goes on from the last one; an evaluation cut short by a crash
or a stop is absent, never half counted. An evaluation that fails (every server moved on or
left, again and again) is logged and skipped: it never fails the training run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from pipelinerl.common.errors import PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.coordinator.evaluation import Evaluator
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.tasks import Problem
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec

log = get_logger(__name__)

POLL_S = 0.2
"""How often the trainer's version is looked at."""
LAST_TIMEOUT_S = 30.0
"""For the evaluation of the last version once training has ended: a run whose inference servers
are gone ends without it rather than wait for them."""
FAILED_RETRY_S = 5.0
"""After a failed evaluation, before the set is tried again."""


class EvaluationSchedule:
    def __init__(
        self,
        run_id: str,
        sets: Sequence[tuple[EvaluationSpec, Sequence[Problem]]],
        evaluator: Evaluator,
        journal: Journal,
        trainer_version: Callable[[], int],
        on_result: Callable[[EvaluationResult], None] = lambda _: None,
    ) -> None:
        self._run_id = run_id
        self._sets = sets
        self._evaluator = evaluator
        self._journal = journal
        self._trainer_version = trainer_version
        self._on_result = on_result
        self.results: list[EvaluationResult] = journal.evaluations(run_id)
        """Every evaluation the run completed, oldest first, across restarts."""

    async def follow(self) -> None:
        """Evaluate each set when it is due, until cancelled."""
        while True:
            for index, (spec, problems) in enumerate(self._sets):
                due = self._due(spec)
                if due is not None and self._trainer_version() >= due:
                    await self._evaluate(index, spec, problems, due)
            await asyncio.sleep(POLL_S)

    async def finish(self) -> None:
        """Evaluate every set at the trainer's last version (unless it already was)."""
        last = self._trainer_version()
        for index, (spec, problems) in enumerate(self._sets):
            if any(r.dataset == spec.dataset and r.weight_version >= last for r in self.results):
                continue
            try:
                await asyncio.wait_for(self._evaluate(index, spec, problems, last), LAST_TIMEOUT_S)
            except TimeoutError:
                log.warning("no server reached the last version in time; not evaluated",
                            dataset=spec.dataset, version=last)  # fmt: skip

    def _due(self, spec: EvaluationSpec) -> int | None:
        """The version at which `spec`'s set is next due: 0 if it was never evaluated."""
        done = [r.weight_version for r in self.results if r.dataset == spec.dataset]
        if not done:
            return 0
        return (max(done) // spec.every_versions + 1) * spec.every_versions

    async def _evaluate(
        self, index: int, spec: EvaluationSpec, problems: Sequence[Problem], due: int
    ) -> None:
        try:
            result = await self._evaluator.evaluate(spec, problems, due, label=f"{self._run_id}-e{index}")
        except PipelineError as exc:
            log.warning("evaluation failed; tried again", dataset=spec.dataset,
                        code=exc.code, error=exc.message)  # fmt: skip
            await asyncio.sleep(FAILED_RETRY_S)
            return
        self._journal.add_evaluation(self._run_id, result)
        self.results.append(result)
        self._on_result(result)
