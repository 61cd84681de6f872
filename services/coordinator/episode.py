"""One multi-turn episode of an environment run, driven by the coordinator: the attempt of a group.

    reserve an environment replica (least loaded, up) ─► StartEpisode(id, the group's seed)
    ─► render the opening with the model's chat template ─► loop:
         generate a turn from the episode's tokens (its inference server pinned: the first turn's)
         ─► parse the turn's token ids into an assistant message ─► StepEpisode(turn, message)
         ─► append only the reply's tokens (episode_tokens.py)
       until the environment ends it, the turn limit, the context, or a turn cut by max_new_tokens
    ─► EndEpisode

Every environment call has a deadline. A call the environment fails (unreachable, too slow, its
code crashed, the episode gone, a reply that breaks the contract: an assistant message, the wrong
shape, the answer to another turn than the one asked) is infrastructure, never scored: the replica
is set down (replicas.py) and the episode starts again from the start, with the same seed, on a
replica that is up, `MAX_TRIES` times in all; then the attempt fails with the last error. A start
or step that meets UNAVAILABLE is first made again on the same turn (a repeat gets the stored
answer); a start a full replica refuses (RESOURCE_EXHAUSTED: it holds its `max_episodes`) is made
again after a pause, not counted as a failure. The model's own mistakes are observations the
environment answers in-band.

Episode ids are `<attempt>.<play>`, the same after a coordinator restart: the restarted coordinator
meets what a replica still holds of the play it lost (a start returns the stored opening, a step of
an earlier turn is FAILED_PRECONDITION), ends it, and plays again under the next id; a replica that
was restarted too holds nothing, and the first play goes on.

A turn is never re-tokenized: what the model sampled stays in the sample as sampled, with its
logprobs and weight versions, and the environment's replies are context tokens (no loss). Where the
token stream cannot be proven equal to a full render of the messages (a fork), the sample ends
there and a new one starts from the full render: the episode plays on, each of its samples is
trained with the whole episode's reward, and `forks` counts them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

from pipelinerl.common.errors import FailedPrecondition, PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason, SamplingParams, Segment, SegmentKind, TokenSequence
from pipelinerl.coordinator.chat_render import ChatRenderer
from pipelinerl.coordinator.episode_tokens import EpisodeTokens, SegmentedTokens
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.replicas import RETRIED, Replica, ReplicaPool
from pipelinerl.coordinator.types import RunSpec
from pipelinerl.environment.client import EnvironmentClient
from pipelinerl.environment.episodes import EpisodeLimits
from pipelinerl.environment.types import EpisodeOpening, Message, Role
from pipelinerl.inference.types import GenerationRequest

log = get_logger(__name__)
T = TypeVar("T")

MAX_TRIES = 3
"""Times an episode is played from the start after environment failures before its attempt fails."""
CALL_TIMEOUT_S = EpisodeLimits().step_timeout_s + 30.0
"""Deadline of one StartEpisode or StepEpisode call: a hanging environment fails its episode. Past
the server's own limit on the environment's code (`step_timeout_s`, 60 s by default), so that code
that hangs is that server's INTERNAL, the episode's failure, and not a DEADLINE_EXCEEDED here, which
would set the whole replica down; what ends past this deadline is a replica that cannot answer."""
END_TIMEOUT_S = 5.0
UNAVAILABLE_RETRIES = 2
"""Times a start or step that met UNAVAILABLE is made again on the same turn before the episode
is played again from the start (a replica that went away loses its episodes: NOT_FOUND then)."""
RETRY_DELAY_S = 0.25
FULL_RETRY_S = 0.5
"""Wait before starting again an episode a full replica refused (RESOURCE_EXHAUSTED at the start:
it holds `max_episodes`); not counted among the episode's failed plays."""
CORRECT = "correct"
"""The reward component that, at 1 or more, counts an episode correct."""


@dataclass(frozen=True)
class Turns:
    """How an episode's turns are generated: on which pool and server first, at which version, how
    sampled."""

    pool: InferencePool
    prefer: str
    weight_version: int | None
    sampling: SamplingParams


@dataclass(frozen=True)
class EpisodeSample:
    """One trained sample of an episode: a prompt, then a completion tiled by segments."""

    prompt_token_ids: list[int]
    completion: TokenSequence
    """Every token after the prompt, model and context alike; logprobs and versions of the model's."""
    segments: tuple[Segment, ...]
    text: str
    """The completion decoded, for the journal and the logs."""


@dataclass
class EpisodeResult:
    """A played episode as its attempt records it."""

    samples: list[EpisodeSample]
    """The first from the opening, then one per fork that holds a model turn."""
    reward: float
    """The sum of every reward component of every step."""
    correct: bool
    finish_reason: FinishReason
    """STOP when the environment terminated it; LENGTH when it was truncated."""
    server: str
    turns: int = 0
    tool_calls: int = 0
    forks: int = 0
    step_seconds: list[float] = field(default_factory=list)
    prefill_tokens: int = 0


class EnvironmentBroke(PipelineError):
    """The environment's reply breaks the contract (an assistant message, for one)."""

    code = "INTERNAL"


class EpisodeDriver:
    """Plays episodes of one run on `environments`, generating turns on `pool`."""

    def __init__(
        self,
        spec: RunSpec,
        pool: InferencePool,
        environments: ReplicaPool[EnvironmentClient],
        renderer: ChatRenderer,
        *,
        max_context: int,
    ) -> None:
        self._spec = spec
        self._pool = pool
        self._environments = environments
        self._renderer = renderer
        self._max_context = max_context
        self.errors = 0
        """Environment calls that failed, in all."""

    async def play(
        self,
        episode_id: str,
        seed: int,
        *,
        prefer: str = "",
        weight_version: int | None = None,
        sampling: SamplingParams | None = None,
        pool: InferencePool | None = None,
    ) -> EpisodeResult:
        """Play episode `episode_id` with `seed` to its end; FailedPrecondition after MAX_TRIES
        plays failed by the environment, another PipelineError when generation fails. An
        evaluation's episode starts on server `prefer` of `pool` (the run's when None), every turn at
        `weight_version`, with its own `sampling` (the run's when None)."""
        turns = Turns(pool or self._pool, prefer, weight_version, sampling or self._spec.sampling)
        failures = 0
        while True:
            async with self._environments.reserve() as replica:
                try:
                    result = await self._play_once(replica, f"{episode_id}.{failures}", seed, turns)
                    self._environments.succeeded(replica)
                    return result
                except EnvironmentFailed as failed:
                    error, call = failed.error, failed.call
                    if error.code in RETRIED:
                        await self._environments.failed(replica, error.code, error.message)
            if error.code == "RESOURCE_EXHAUSTED" and call == "start":  # full: not a failure
                log.info("environment replica full; starting the episode again", replica=replica.address)
                await asyncio.sleep(FULL_RETRY_S)
                continue
            failures += 1
            self.errors += 1
            log.warning(
                "environment failed an episode; playing it again from the start",
                episode_id=episode_id, replica=replica.address, code=error.code, error=error.message,
                tries=failures,
            )  # fmt: skip
            if failures >= MAX_TRIES:
                raise FailedPrecondition(
                    f"the environment failed episode {episode_id} {failures} times, the last with "
                    f"{error.code}: {error.message}"
                )

    async def _play_once(
        self, replica: Replica[EnvironmentClient], episode_id: str, seed: int, turns: Turns
    ) -> EpisodeResult:
        env = replica.client
        opening = await _call(partial(env.start, episode_id, seed=seed, timeout_s=CALL_TIMEOUT_S), "start")
        try:
            return await self._turns(env, episode_id, opening, turns)
        finally:
            try:
                await env.end(episode_id, timeout_s=END_TIMEOUT_S)
            except PipelineError as exc:  # the replica reaps it after its lease anyway
                log.debug("EndEpisode failed", episode_id=episode_id, code=exc.code)

    async def _turns(
        self,
        env: EnvironmentClient,
        episode_id: str,
        opening: EpisodeOpening,
        turns: Turns,
    ) -> EpisodeResult:
        _check_reply(opening.messages)
        max_turns = min((t for t in (self._spec.max_turns, opening.max_turns) if t > 0), default=0)
        tokens = EpisodeTokens(self._renderer, opening.messages, opening.tools, max_context=self._max_context)
        server, reward, correct, truncated = turns.prefer, 0.0, False, False
        tool_calls, prefill, step_seconds = 0, 0, []
        while True:
            budget = tokens.max_new_tokens(turns.sampling.max_new_tokens)
            if budget == 0:
                truncated = True  # the context is full
                break
            prompt = tokens.token_ids
            prefill += len(prompt)
            sampling = dataclasses.replace(turns.sampling, max_new_tokens=budget)
            request = GenerationRequest(
                f"{episode_id}-t{tokens.turns + 1}",
                prompt,
                sampling,
                weight_version=turns.weight_version,
                prompt_cache_key=episode_id,  # the server keeps the turn's cache for the next one
            )
            server, completion = await turns.pool.generate(request, prefer=server)
            turn = tokens.add_turn(completion.tokens, completion.finish_reason)
            tool_calls += len(turn.message.tool_calls)
            if turn.truncated:
                truncated = True  # cut by max_new_tokens: never bridged
                break
            started = time.monotonic()
            step_call = partial(env.step, episode_id, tokens.turns, turn.message, timeout_s=CALL_TIMEOUT_S)
            step = await _call(step_call, "step")
            _check_turn(step.turn, tokens.turns)
            step_seconds.append(time.monotonic() - started)
            reward += step.reward
            correct = correct or any(c.name == CORRECT and c.value >= 1.0 for c in step.rewards)
            if step.ended:
                truncated = step.truncated and not step.terminated
                break
            if max_turns and tokens.turns >= max_turns:
                truncated = True
                break
            _check_reply(step.messages)
            tokens.add_reply(step.messages)
        samples = [self._sample(s) for s in tokens.samples() if s.model_spans]
        if not samples:  # not one turn fit: the opening fills the context
            raise FailedPrecondition(
                f"the episode's opening leaves no room for a turn in a context of {self._max_context} tokens"
            )
        log.debug("episode played", episode_id=episode_id, turns=tokens.turns, reward=reward,
                  forks=tokens.forks, samples=len(samples))  # fmt: skip
        return EpisodeResult(
            samples,
            reward,
            correct,
            FinishReason.LENGTH if truncated else FinishReason.STOP,
            server,
            turns=tokens.turns,
            tool_calls=tool_calls,
            forks=tokens.forks,
            step_seconds=step_seconds,
            prefill_tokens=prefill,
        )

    def _sample(self, tokens: SegmentedTokens) -> EpisodeSample:
        prompt, completion, segments = _split(tokens)
        return EpisodeSample(prompt, completion, segments, self._renderer.decode(completion.token_ids))


class EnvironmentFailed(Exception):
    """An environment (or agent host) call of one play failed: `play` retries the episode or
    gives up on it."""

    def __init__(self, error: PipelineError, call: str) -> None:
        super().__init__(error.message)
        self.error, self.call = error, call


async def _call(call: Callable[[], Awaitable[T]], name: str) -> T:
    """An environment call's result, the call made again on UNAVAILABLE (starting and stepping are
    idempotent: a repeat gets the stored answer), UNAVAILABLE_RETRIES times at most; its failure as
    `EnvironmentFailed` (a generation's failure is not the environment's, so it is not caught
    where turns are generated)."""
    for retry in range(UNAVAILABLE_RETRIES + 1):
        try:
            return await call()
        except PipelineError as exc:
            if exc.code != "UNAVAILABLE" or retry == UNAVAILABLE_RETRIES:
                raise EnvironmentFailed(exc, name) from exc
            await asyncio.sleep(RETRY_DELAY_S * 2**retry)
    raise AssertionError("unreachable")


def _check_reply(messages: Sequence[Message]) -> None:
    if any(m.role is Role.ASSISTANT for m in messages):
        raise EnvironmentFailed(EnvironmentBroke("the environment replied with an assistant message"), "step")


def _check_turn(answered: int, asked: int) -> None:
    """A reply says which turn it answers (0: a server that predates the field, not checked); the
    reply to another turn is not an answer to the model's, whatever it holds."""
    if answered and answered != asked:
        raise EnvironmentFailed(
            EnvironmentBroke(f"the environment answered turn {answered} when asked turn {asked}"), "step"
        )


def _split(sample: SegmentedTokens) -> tuple[list[int], TokenSequence, tuple[Segment, ...]]:
    """A sample as the trainer's record: the prompt, then the completion tiled by segments."""
    start = sample.prompt_length
    segments = tuple(
        Segment(SegmentKind.MODEL if is_model else SegmentKind.CONTEXT, end - begin)
        for begin, end, is_model in sample.segments()
        if begin >= start
    )
    completion = TokenSequence(list(sample.token_ids[start:]), list(sample.logprobs), list(sample.versions))
    return list(sample.token_ids[:start]), completion, segments
