"""One RL run: prompts become groups of attempts that flow through inference, reward and trainer.

    problems ──► group of G attempts (journal: created) ──► InferencePool.generate ×G (dispatched,
    generated) ──► RewardPool.score (scored) ──► TrainerSubmitter.send ──► trained ──► acked
    once the trainer's checkpoint holds it (see submitter.py)

In an environment run an attempt is a multi-turn episode (episode.py): the G attempts of a group
play the episode of one seed, the environment rewards them, and they skip the reward service. An
episode is journaled once played (generated and scored together, with the samples its forks added
as attempts `<attempt>~<n>` of its group); one cut short by a restart is played again from the
start.

When every group in flight waits on the trainer and no more can start (the budget is spent, the
dataset ended, the slots are full, or a sync round is complete), the trainer is asked to flush:
it trains the samples it holds as a step of its own, however few. It ignores a flush while a step
is under way or due, so the ask is repeated each time a group finishes. A run ends once every
attempt is final and, after a last flush with a checkpoint, every trained one durable.

Pipeline mode keeps up to `max_in_flight` attempts moving at once, so generation never waits for
training: weights change under running generations. Sync mode is the conventional baseline on
the same services: a round of `max_in_flight` attempts is generated with one weight version,
scored, trained on, and the next round starts only once every inference server has the new version.
A round reaches the trainer only once all of it is scored, so a round of several steps' samples (the
conventional variant: `max_in_flight` a multiple of the trainer's samples per step) is generated
with one version and then trained by several steps in a row, its later steps on older samples.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from pipelinerl.common.errors import FailedPrecondition, PipelineError
from pipelinerl.common.log import bind_context, get_logger
from pipelinerl.common.types import FinishReason, Sample
from pipelinerl.coordinator.datasets import ENVIRONMENT
from pipelinerl.coordinator.episode import EpisodeDriver, EpisodeResult
from pipelinerl.coordinator.eval_schedule import EvaluationSchedule
from pipelinerl.coordinator.journal import FORK, AttemptRecord, GroupRecord, Journal
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.reward_pool import RewardPool
from pipelinerl.coordinator.submitter import TrainerSubmitter
from pipelinerl.coordinator.tasks import Problem
from pipelinerl.coordinator.types import (
    EpisodeStats,
    EvaluationResult,
    Mode,
    Progress,
    RunSpec,
    ServerVersion,
)
from pipelinerl.inference.types import GenerationRequest
from pipelinerl.reward.types import ScoreItem
from pipelinerl.trainer.advantages import all_equal
from pipelinerl.trainer.types import Disposition, SampleAck

log = get_logger(__name__)

WINDOW = 256  # samples in the moving averages of reward, correctness, lag and entropy
GROUP_WINDOW = 32  # groups in the moving zero-variance fraction
SCORE_TIMEOUT_S = 60.0  # per Score call; past it the batch goes to another replica
STOP_GRACE_S = 10.0
MAX_FAILURES_IN_A_ROW = 64
"""Attempts refused in a row, none generated between, that fail the run: its spec is one no
server can serve (an endless dataset would otherwise dispatch refused attempts forever)."""


@dataclass
class _Counters:
    dispatched: int = 0
    generated: int = 0
    scored: int = 0
    trained: int = 0
    dropped: int = 0

    @classmethod
    def so_far(cls, counts: dict[str, int], forked: int = 0) -> _Counters:
        """The run's counters from the journal's `counts`, so a resumed run's budget and progress
        span restarts. Attempts still in flight count as far as they got, once: generated and
        scored are counted where that happens, and a resend's DUPLICATE ack counts as nothing.
        `forked` samples (the journal's `forked`) count as generated and beyond, as when they were
        played, but not as dispatched: the budget counts the attempts groups are made with."""
        acked = {key.removeprefix("acked:"): n for key, n in counts.items() if key.startswith("acked:")}
        failed = sum(n for d, n in acked.items() if d.startswith("failed:"))
        unscored = sum(n for d, n in acked.items() if d.startswith("unscored:"))
        scored = counts.get("scored", 0) + counts.get("trained", 0) + sum(acked.values()) - failed - unscored
        return cls(
            dispatched=sum(counts.values()) - forked,
            generated=counts.get("generated", 0) + scored + unscored,
            scored=scored,
            trained=acked.get("trained", 0) + counts.get("trained", 0),
            dropped=acked.get("dropped", 0),
        )


class RunLoop:
    def __init__(
        self,
        run_id: str,
        spec: RunSpec,
        journal: Journal,
        pool: InferencePool,
        reward: RewardPool,
        submitter: TrainerSubmitter,
        problems: Iterator[tuple[int, Problem]],
        episodes: EpisodeDriver | None = None,
        evaluations: EvaluationSchedule | None = None,
    ) -> None:
        self.run_id = run_id
        self.spec = spec
        self._journal = journal
        self._pool = pool
        self._reward = reward
        self._submitter = submitter
        self._problems = problems
        self._episodes = episodes
        self._evaluations = evaluations
        self._episode_stats = _EpisodeCounters()
        self._forks: dict[str, list[AttemptRecord]] = {}
        """The attempts each episode's forks added, until its group journals them."""
        self._counts = _Counters.so_far(journal.counts(run_id), journal.forked(run_id))  # zeros for a new run
        self._rewards: deque[float] = deque(maxlen=WINDOW)
        self._correct: deque[bool] = deque(maxlen=WINDOW)
        self._lags: deque[float] = deque(maxlen=WINDOW)
        self._surprisal: deque[float] = deque(maxlen=WINDOW)  # mean -logprob per token, per attempt
        self._flat: deque[bool] = deque(maxlen=GROUP_WINDOW)
        self._trained_at: deque[tuple[float, int]] = deque(maxlen=64)
        self._in_flight = 0
        self._groups = 0
        self._groups_at_trainer = 0
        self._slots = asyncio.Condition()
        self._failure: BaseException | None = None
        self._dispatch_ended = False
        self._failures_in_a_row = 0
        self._round: set[str] = set()  # sync mode: groups of this round not yet scored
        self._round_scored = asyncio.Event()
        self._round_scored.set()
        self.stopping = False

    # ---- progress -----------------------------------------------------------------------------

    def progress(self) -> Progress:
        c = self._counts
        return Progress(
            dispatched=c.dispatched,
            generated=c.generated,
            scored=c.scored,
            trained=c.trained,
            dropped=c.dropped,
            samples_per_s=self._samples_per_s(),
            reward_mean=statistics.fmean(self._rewards) if self._rewards else 0.0,
            correct_fraction=statistics.fmean(self._correct) if self._correct else 0.0,
            lag_mean=statistics.fmean(self._lags) if self._lags else 0.0,
            trainer_version=self._submitter.latest_version,
            servers=tuple(ServerVersion(a, v, n) for a, v, n in self._pool.snapshot()),
            zero_variance_fraction=statistics.fmean(self._flat) if self._flat else 0.0,
            entropy=statistics.fmean(self._surprisal) if self._surprisal else 0.0,
            episodes=self._episode_stats.stats(self._episodes) if self._episodes else None,
        )

    def _samples_per_s(self) -> float:
        if len(self._trained_at) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._trained_at[0], self._trained_at[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    # ---- driving ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Resume unfinished groups, then dispatch until max_samples, the dataset's end or a stop;
        evaluate the held-out sets when due meanwhile, and at the last version once trained."""
        resumed = list(self._journal.unfinished_groups(self.run_id))
        if resumed:
            log.info("resuming groups from the journal", groups=len(resumed))
        trained = [(g, a) for g in resumed for a in g.attempts if a.state == "trained"]
        self._submitter.keep([_sample(g, a, len(g.attempts)) for g, a in trained], self._retracted)
        tasks = {asyncio.create_task(self._run_group(group)) for group in resumed}
        self._in_flight += sum(len(g.attempts) for g in resumed)
        self._groups += len(resumed)
        if self.spec.mode is Mode.SYNC:
            await asyncio.gather(*tasks)
            tasks = set()
        evaluating = asyncio.create_task(self._evaluations.follow()) if self._evaluations else None
        try:
            await self._dispatch(tasks)
        finally:
            if evaluating is not None:
                evaluating.cancel()
                await asyncio.gather(evaluating, return_exceptions=True)
        if self._evaluations is not None:  # a stopped run's last version too: it may be the last
            await self._evaluations.finish()

    @property
    def evaluations(self) -> tuple[EvaluationResult, ...]:
        return tuple(self._evaluations.results) if self._evaluations else ()

    async def _dispatch(self, tasks: set[asyncio.Task[None]]) -> None:
        """Start groups until max_samples, the dataset's end or a stop, then see them through."""
        group_size = self.spec.group_size
        while not self._done_dispatching():
            if self.spec.mode is Mode.SYNC:
                await self._sync_round()
                continue
            async with self._slots:
                await self._slots.wait_for(
                    lambda: self.stopping or self._in_flight + group_size <= self.spec.max_in_flight
                )
                if self.stopping:
                    break
                self._in_flight += group_size
                self._groups += 1
            group = self._new_group()
            if group is None:
                await self._release(group_size)
                break
            task = asyncio.create_task(self._run_group(group))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        self._dispatch_ended = True
        self._maybe_flush()
        await self._finish(tasks)
        if self._failure is not None:
            raise self._failure
        # Wait until a trainer checkpoint holds every trained attempt; after a stop, for a while
        # (what is left stays `trained` in the journal, and a resumed run resends it).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._submitter.settle(), STOP_GRACE_S if self.stopping else None)

    async def _finish(self, tasks: set[asyncio.Task[None]]) -> None:
        """Let groups in flight finish; after a stop, give them `STOP_GRACE_S`, then leave the rest
        to the journal (a partial trainer batch may never be acked until more samples come)."""
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=STOP_GRACE_S if self.stopping else None)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            log.info("stopped with groups in flight; the journal resumes them", groups=len(pending))

    async def stop(self) -> None:
        """Stop dispatching; `run` returns once the groups in flight are done (or their grace is up)."""
        async with self._slots:
            self.stopping = True
            self._slots.notify_all()

    def _done_dispatching(self) -> bool:
        budget = self.spec.max_samples
        return self.stopping or (budget > 0 and self._counts.dispatched >= budget)

    async def _sync_round(self) -> None:
        groups = []
        for _ in range(max(self.spec.max_in_flight // self.spec.group_size, 1)):
            if self._done_dispatching() or (group := self._new_group()) is None:
                break
            groups.append(group)
        self._in_flight += sum(len(g.attempts) for g in groups)
        self._groups += len(groups)
        self._round = {g.group_id for g in groups}
        self._round_scored.clear()
        self._leave_round(None)  # an empty round is scored already
        self._dispatch_ended = True  # for this round: its groups are all there will be
        await asyncio.gather(*(self._run_group(g) for g in groups))
        self._dispatch_ended = False
        # The next round generates only with the weights trained on this one.
        await self._pool.wait_for_version(self._submitter.latest_version)

    def _new_group(self) -> GroupRecord | None:
        try:
            index, problem = next(self._problems)
        except StopIteration:
            return None
        group_id = f"{self.run_id}-p{index}"
        attempts = [AttemptRecord(f"{group_id}-a{i}", "created") for i in range(self.spec.group_size)]
        group = GroupRecord(group_id, index, problem.prompt, problem.answer, problem.verifier, attempts)
        self._journal.add_group(self.run_id, group)
        self._counts.dispatched += len(attempts)
        return group

    async def _release(self, attempts: int) -> None:
        async with self._slots:
            self._in_flight -= attempts
            self._groups -= 1
            self._slots.notify_all()
        self._maybe_flush()  # the trainer ignores a flush while it steps: ask again once it has

    def _maybe_flush(self) -> None:
        """Flush the trainer when every group in flight waits on it and no group can start."""
        blocked = self._dispatch_ended or self._in_flight + self.spec.group_size > self.spec.max_in_flight
        if self._groups_at_trainer and self._groups_at_trainer == self._groups and blocked:
            self._submitter.flush()

    # ---- one group ----------------------------------------------------------------------------

    async def _run_group(self, group: GroupRecord) -> None:
        bind_context(group_id=group.group_id)  # this task's log lines and calls carry it (trace.py)
        size = len(group.attempts)  # as counted in flight: an episode's forks add attempts
        try:
            pending = [a for a in group.attempts if a.state in ("created", "dispatched")]
            self._journal.mark_dispatched([a.sample_id for a in pending])
            await asyncio.gather(*(self._generate(group, a) for a in pending))
            # Journaled once all are back: one not journaled is generated again on a restart.
            if group.verifier == ENVIRONMENT:  # played and scored at once, with any forks' samples
                group.attempts += [f for a in pending for f in self._forks.pop(a.sample_id, [])]
                played = [a for a in group.attempts if a.state == "generated"]
                self._journal.mark_played(group.group_id, played)
            else:
                self._journal.mark_generated([a for a in pending if a.state == "generated"])
            usable = [a for a in group.attempts if a.completion is not None and a.state != "acked"]
            await self._score(group, [a for a in usable if a.state == "generated"])
            self._leave_round(group.group_id)
            await self._round_scored.wait()
            await self._train(group, [a for a in usable if a.state == "scored"])
        except Exception as exc:  # unexpected: stop dispatching and fail the run with it
            log.exception("group failed", group_id=group.group_id)
            self._failure = self._failure or exc
            self.stopping = True
        finally:
            self._leave_round(group.group_id)  # a failed or cancelled group holds up no other
            await self._release(size)

    def _leave_round(self, group_id: str | None) -> None:
        self._round.discard(group_id or "")
        if not self._round:
            self._round_scored.set()

    async def _generate(self, group: GroupRecord, attempt: AttemptRecord) -> None:
        bind_context(sample_id=attempt.sample_id)
        try:
            if self._episodes is not None:
                await self._play(group, attempt, self._episodes)
                return
            request = GenerationRequest(attempt.sample_id, [], self.spec.sampling, prompt_text=group.prompt)
            server, completion = await self._pool.generate(request)
        except PipelineError as exc:  # e.g. a prompt the model cannot take: this attempt is lost, not the run
            log.warning("attempt failed", sample_id=attempt.sample_id, code=exc.code, error=exc.message)
            self._journal.mark_acked(attempt.sample_id, f"failed:{exc.code}", -1)
            attempt.state = "acked"
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= MAX_FAILURES_IN_A_ROW and self._failure is None:
                self._failure = FailedPrecondition(
                    f"{self._failures_in_a_row} attempts in a row were refused, the last with "
                    f"{exc.code}: {exc.message}"
                )
                self.stopping = True
            return
        self._failures_in_a_row = 0
        versions = sorted(set(completion.tokens.versions))
        log.debug("attempt generated", server=server, tokens=len(completion.tokens), versions=versions,
                 finish_reason=completion.finish_reason.value)  # fmt: skip
        attempt.state, attempt.completion = "generated", completion.tokens
        attempt.prompt_token_ids, attempt.text = completion.prompt_token_ids, completion.text
        attempt.finish_reason, attempt.server = completion.finish_reason, server
        self._counts.generated += 1
        if completion.tokens.logprobs:
            self._surprisal.append(-statistics.fmean(completion.tokens.logprobs))

    async def _play(self, group: GroupRecord, attempt: AttemptRecord, episodes: EpisodeDriver) -> None:
        """Play `attempt`'s episode (the group's seed is its prompt); the environment scores it."""
        result = await episodes.play(attempt.sample_id, int(group.prompt))
        self._failures_in_a_row = 0
        # the first sample is the attempt's; each later one (after a fork) an attempt of its own
        records = [attempt] + [
            AttemptRecord(f"{attempt.sample_id}{FORK}{n}", "") for n in range(1, len(result.samples))
        ]
        for record, sample in zip(records, result.samples, strict=True):
            record.state, record.completion, record.segments = "generated", sample.completion, sample.segments
            record.prompt_token_ids, record.text = sample.prompt_token_ids, sample.text
            record.finish_reason, record.server = result.finish_reason, result.server
            record.reward, record.correct = result.reward, result.correct
            if sample.completion.logprobs:
                self._surprisal.append(-statistics.fmean(sample.completion.logprobs))
        self._forks[attempt.sample_id] = records[1:]
        self._counts.generated += len(records)
        self._episode_stats.add(result)

    async def _score(self, group: GroupRecord, attempts: list[AttemptRecord]) -> None:
        if not attempts:
            return
        if group.verifier == ENVIRONMENT:  # rewarded by the environment, journaled as played
            self._scored([(a, a.reward or 0.0, a.correct) for a in attempts])
            return
        items = [ScoreItem(a.sample_id, group.prompt, a.text, group.answer, group.verifier) for a in attempts]
        # Waits while no replica is up; a batch a replica fails is sent again whole (reward_pool.py).
        results = await self._reward.score(items, timeout_s=SCORE_TIMEOUT_S)
        scored = []
        for attempt, result in zip(attempts, results, strict=True):
            if result.error is not None or result.reward is None:
                log.warning("sample not scored", sample_id=attempt.sample_id, error=result.error)
                self._journal.mark_acked(
                    attempt.sample_id, f"unscored:{result.error.code if result.error else ''}", -1
                )
                attempt.state = "acked"
                continue
            correct = any(d.verifier == group.verifier and d.score >= 1.0 for d in result.details)
            scored.append((attempt, result.reward, correct))
        self._journal.mark_scored([(a.sample_id, reward, correct) for a, reward, correct in scored])
        self._scored(scored)

    def _scored(self, scored: list[tuple[AttemptRecord, float, bool]]) -> None:
        for attempt, reward, correct in scored:
            log.debug("attempt scored", sample_id=attempt.sample_id, reward=reward, correct=correct)
            attempt.state, attempt.reward, attempt.correct = "scored", reward, correct
            self._rewards.append(reward)
            self._correct.append(correct)
        self._counts.scored += len(scored)
        if len(scored) > 1:
            self._flat.append(all_equal([reward for _, reward, _ in scored]))

    async def _train(self, group: GroupRecord, attempts: list[AttemptRecord]) -> None:
        if not attempts:
            return
        samples = [_sample(group, a, len(attempts)) for a in attempts]
        futures = self._submitter.send(samples, self._retracted)
        self._groups_at_trainer += 1
        self._maybe_flush()  # after the samples: the trainer reads its stream in order
        try:
            acks = {sample_id: await future for sample_id, future in futures.items()}
        finally:
            self._groups_at_trainer -= 1
        for sample in samples:
            ack = acks[sample.sample_id]  # the submitter has journaled it
            log.debug("attempt acked", sample_id=sample.sample_id, disposition=ack.disposition.value,
                     version=ack.version)  # fmt: skip
            if ack.disposition in (Disposition.TRAINED, Disposition.DUPLICATE):
                self._counts.trained += 1
            if ack.disposition is Disposition.TRAINED:
                trained_at = ack.version - 1
                self._lags.append(statistics.fmean(trained_at - v for v in sample.completion.versions))
            elif ack.disposition is Disposition.DROPPED:
                self._counts.dropped += 1
        self._trained_at.append((time.monotonic(), self._counts.trained))

    def _retracted(self, ack: SampleAck) -> None:
        """A sample counted trained whose step was lost with the trainer, and whose resend ended
        otherwise (dropped for lag): the journal holds it so, and so must the run's counts."""
        self._counts.trained -= 1
        if ack.disposition is Disposition.DROPPED:
            self._counts.dropped += 1


def _sample(group: GroupRecord, attempt: AttemptRecord, group_size: int) -> Sample:
    assert attempt.completion is not None, "only generated attempts are trained"
    return Sample(
        attempt.sample_id,
        group.group_id,
        attempt.prompt_token_ids or [],
        attempt.completion,
        attempt.reward or 0.0,
        attempt.finish_reason or FinishReason.STOP,
        group_size=group_size,
        segments=attempt.segments,
    )


class _EpisodeCounters:
    """Totals and moving windows of the episodes played (`Progress.episodes`)."""

    def __init__(self) -> None:
        self.episodes = self.tool_calls = self.truncated = self.forks = 0
        self._turns: deque[int] = deque(maxlen=WINDOW)
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._prefill: deque[int] = deque(maxlen=WINDOW)

    def add(self, result: EpisodeResult) -> None:
        self.episodes += 1
        self.tool_calls += result.tool_calls
        self.truncated += result.finish_reason is FinishReason.LENGTH
        self.forks += result.forks
        self._turns.append(result.turns)
        self._steps.extend(result.step_seconds)
        self._prefill.append(result.prefill_tokens)

    def stats(self, driver: EpisodeDriver) -> EpisodeStats:
        return EpisodeStats(
            episodes=self.episodes,
            turns_mean=statistics.fmean(self._turns) if self._turns else 0.0,
            tool_calls=self.tool_calls,
            truncated=self.truncated,
            forks=self.forks,
            environment_errors=driver.errors,
            step_seconds_mean=statistics.fmean(self._steps) if self._steps else 0.0,
            prefill_tokens_mean=statistics.fmean(self._prefill) if self._prefill else 0.0,
        )
