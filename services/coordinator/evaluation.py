"""Held-out evaluation: one set at one weight version, every token attributed to that version.

    a server holding version v ─► every completion of the set requested with `weight_version` v
    (the server admits them only while it holds v, and swaps in no newer version until the last
    one finishes) ─► scored by the reward service (or played and scored by the environment)
    ─► EvaluationResult: mean reward, pass@1, unbiased pass@k, length, truncations

The server is an evaluation server (`InferenceRole.EVALUATION`: it takes no training attempt, so
holding it at v holds up no training and its evaluations take no training server's rows) while one
is connected, and otherwise the training server with the newest version.

The same evaluation runs outside any run (`evaluate_once`: the Evaluate RPC and `pipelinerl eval`),
on the same servers, at the newest version one of them holds.

An evaluation is whole or absent: a server that moved past v before taking the first request
refuses them all (FAILED_PRECONDITION), and one that leaves takes its requests with it; either way
the evaluation is abandoned and tried again, whole, at the version a server holds then
(`MAX_TRIES` times). Its completions never reach the trainer or the attempt journal.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from pipelinerl.common.errors import FailedPrecondition, PipelineError, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason
from pipelinerl.coordinator.datasets import ENVIRONMENT, evaluation_problems
from pipelinerl.coordinator.episode import EpisodeDriver
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.reward_pool import RewardPool
from pipelinerl.coordinator.tasks import Problem
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec
from pipelinerl.inference.types import GenerationRequest
from pipelinerl.reward.types import ScoreItem

log = get_logger(__name__)
T = TypeVar("T")

MAX_TRIES = 5
"""Evaluations of one set abandoned in a row (a server moved on or left) before it fails."""
SCORE_TIMEOUT_S = 60.0
SERVER_POLL_S = 0.1
CONNECT_GRACE_S = 5.0
"""How long an evaluation waits for a pool's members to connect before it takes the next pool."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem from `n` completions of which `c` are correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code"): 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 < k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def problems_outside_a_run(spec: EvaluationSpec, tokenizer: str | None) -> list[Problem]:
    """The problems of a set evaluated outside any run: a built-in task's held-out ones, every
    row of a file (no run holds any of it out); InvalidArgument when the set cannot be read."""
    return evaluation_problems(
        spec.dataset, run_dataset="", seed=0, eval_split=0.0, tokenizer=tokenizer, limit=spec.max_problems,
        field="evaluation.dataset",
    )  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """One completion of an evaluation, scored."""

    reward: float
    correct: bool
    tokens: int
    truncated: bool


def summarize(
    dataset: str, version: int, outcomes: Sequence[Sequence[Outcome]], duration_s: float, server: str
) -> EvaluationResult:
    """The figures of one evaluation from the outcomes of each problem (k completions each)."""
    flat = [o for problem in outcomes for o in problem]
    k = len(outcomes[0])
    return EvaluationResult(
        dataset=dataset,
        weight_version=version,
        problems=len(outcomes),
        samples_per_problem=k,
        reward_mean=statistics.fmean(o.reward for o in flat),
        pass_at_1=statistics.fmean(o.correct for o in flat),
        pass_at_k=statistics.fmean(pass_at_k(k, sum(o.correct for o in p), k) for p in outcomes),
        completion_tokens_mean=statistics.fmean(o.tokens for o in flat),
        truncated_fraction=statistics.fmean(o.truncated for o in flat),
        finished_at=datetime.now(UTC),
        duration_s=duration_s,
        server=server,
    )


async def _all(calls: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Every call's result; at the first that fails, the others are cancelled (and awaited) before
    its error is raised, so that no request of an abandoned evaluation lives on."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Abandoned(Exception):
    """The server moved past the version, or left, before the evaluation was whole."""

    def __init__(self, error: PipelineError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.moved_on = isinstance(error, FailedPrecondition)


class Evaluator:
    """Evaluates sets on the evaluation servers, or the training servers while none is connected,
    at a version one of them holds."""

    def __init__(
        self,
        pool: InferencePool,
        reward: RewardPool,
        episodes: EpisodeDriver | None = None,
        evaluation_pool: InferencePool | None = None,
    ) -> None:
        self._pools = [p for p in (evaluation_pool, pool) if p is not None]
        """In order of preference."""
        self._reward = reward
        self._episodes = episodes
        self._tries = itertools.count()
        """Numbers each try, so that no two share a request id: a request of an abandoned try may
        still be on its way out of a server's stream when the next one starts."""

    async def evaluate(
        self, spec: EvaluationSpec, problems: Sequence[Problem], at_least: int = 0, label: str = "eval"
    ) -> EvaluationResult:
        """Evaluate `problems` at the newest version a connected server holds, once one holds
        `at_least` or newer. Request ids start with `label`. FailedPrecondition after MAX_TRIES
        abandoned tries."""
        for attempt in range(1, MAX_TRIES + 1):
            pool, server, version = await self._server_at(at_least)
            started = time.monotonic()
            try:
                label_of_try = f"{label}-v{version}.{next(self._tries)}"
                outcomes = await self._run(spec, problems, pool, server, version, label_of_try)
            except _Abandoned as exc:
                log.warning("evaluation abandoned; trying again", dataset=spec.dataset, version=version,
                            server=server, attempt=attempt, why=str(exc))  # fmt: skip
                at_least = version + 1 if exc.moved_on else at_least
                continue
            result = summarize(spec.dataset, version, outcomes, time.monotonic() - started, server)
            log.info("evaluated", dataset=spec.dataset, version=version, pass_at_1=round(result.pass_at_1, 4),
                     seconds=round(result.duration_s, 2))  # fmt: skip
            return result
        raise FailedPrecondition(f"{spec.dataset}: {MAX_TRIES} evaluations in a row were abandoned")

    async def evaluate_once(
        self, spec: EvaluationSpec, problems: Sequence[Problem], label: str, connect_timeout_s: float
    ) -> EvaluationResult:
        """`problems` (`problems_outside_a_run`) evaluated outside any run, at the newest version
        a server holds: Unavailable when no inference server (of the evaluation servers, if the
        coordinator has any) connects within `connect_timeout_s`, InvalidArgument on `evaluation`
        when they would refuse its sampling."""
        pool = next(p for p in self._pools if p.members or p is self._pools[-1])
        limits = await pool.limits(connect_timeout_s)
        limits.check_new_tokens(spec.sampling.max_new_tokens, "evaluation.sampling.max_new_tokens")
        return await self.evaluate(spec, problems, label=label)

    async def _server_at(self, at_least: int) -> tuple[InferencePool, str, int]:
        """(pool, address, version) of the connected server with the newest version in the first
        pool that has one connected, once it is `at_least`. A pool whose members are all still
        connecting (a server just started or restarted) is waited for up to CONNECT_GRACE_S."""
        started = time.monotonic()
        while True:
            for pool in self._pools:
                held = await pool.versions()
                if not held and pool.members and time.monotonic() - started < CONNECT_GRACE_S:
                    break
                if held:
                    address = max(held, key=lambda a: held[a])
                    if held[address] >= at_least:
                        return pool, address, held[address]
                    break  # wait for this pool's servers rather than fall back to the next
            await asyncio.sleep(SERVER_POLL_S)

    async def _run(
        self,
        spec: EvaluationSpec,
        problems: Sequence[Problem],
        pool: InferencePool,
        server: str,
        version: int,
        label: str,
    ) -> list[list[Outcome]]:
        k = spec.samples_per_problem
        ids = [[f"{label}-p{i}-s{j}" for j in range(k)] for i in range(len(problems))]
        if problems and problems[0].verifier == ENVIRONMENT:
            return await self._play(problems, ids, pool, server, version)
        requests = [
            GenerationRequest(rid, [], spec.sampling, prompt_text=p.prompt, weight_version=version)
            for p, row in zip(problems, ids, strict=True)
            for rid in row
        ]
        try:
            generated = await _all([pool.generate(r, prefer=server) for r in requests])
        except (FailedPrecondition, Unavailable) as exc:
            raise _Abandoned(exc) from exc
        completions = {c.request_id: c for _, c in generated}
        for completion in completions.values():
            if any(v != version for v in completion.tokens.versions):  # the server broke its word
                raise PipelineError(f"{completion.request_id} has tokens of versions other than {version}")
        items = [
            ScoreItem(rid, p.prompt, completions[rid].text, p.answer, p.verifier)
            for p, row in zip(problems, ids, strict=True)
            for rid in row
        ]
        scores = {s.sample_id: s for s in await self._reward.score(items, timeout_s=SCORE_TIMEOUT_S)}
        outcomes = []
        for problem, row in zip(problems, ids, strict=True):
            outcomes.append([])
            for rid in row:
                score, completion = scores[rid], completions[rid]
                if score.reward is None:
                    log.warning("evaluation completion not scored; counted as wrong", request_id=rid,
                                error=score.error)  # fmt: skip
                correct = any(d.verifier == problem.verifier and d.score >= 1.0 for d in score.details)
                outcomes[-1].append(
                    Outcome(
                        score.reward or 0.0,
                        correct,
                        len(completion.tokens),
                        completion.finish_reason is FinishReason.LENGTH,
                    )
                )
        return outcomes

    async def _play(
        self,
        problems: Sequence[Problem],
        ids: list[list[str]],
        pool: InferencePool,
        server: str,
        version: int,
    ) -> list[list[Outcome]]:
        """Episodes of held-out seeds (the problem's prompt), every turn at `version`."""
        episodes = self._episodes
        if episodes is None:
            raise FailedPrecondition("an environment evaluation needs an environment run")
        try:
            results = await _all(
                [
                    episodes.play(rid, int(p.prompt), prefer=server, weight_version=version, pool=pool)
                    for p, row in zip(problems, ids, strict=True)
                    for rid in row
                ]
            )
        except (FailedPrecondition, Unavailable) as exc:
            raise _Abandoned(exc) from exc
        flat = [
            Outcome(
                r.reward,
                r.correct,
                sum(len(s.completion) for s in r.samples),
                r.finish_reason is FinishReason.LENGTH,
            )
            for r in results
        ]
        k = len(ids[0])
        return [flat[i * k : (i + 1) * k] for i in range(len(problems))]
