"""The episode table: one environment instance per episode, leases, idempotent calls, limits.

    start(id, seed, task) ──► new instance ── reset ──► opening (stored)
    step(id, turn, action) ─► instance.step ──► reply (stored as the last turn's answer)
    end(id) / the lease runs out (reaper) / the episode fails ──► the instance is closed

What each call answers, and what it leaves held:
- `start` of a held id with the same seed and task returns the stored opening (also while the first
  call is still running: both wait on the same reset); with another seed or task, FailedPrecondition.
  A start beyond `max_episodes` held is ResourceExhausted; while draining, Unavailable.
- `step` of the next turn runs the instance's `step`; of the turn answered last, with the same
  action, returns the stored answer (also while it runs); any other turn, or the same turn with
  another action, is FailedPrecondition. An episode that terminated or was truncated stays held,
  its instance closed, so that its last turn can be retried: a further turn is FailedPrecondition.
- The environment's code runs under `step_timeout_s` per call (the constructor and reset together,
  each step). When it raises, runs past that limit, or returns what the contract forbids (an
  assistant message, a tool result for a call the model did not make, more than
  `max_observation_bytes` of content, a reward that is not a finite number), the episode is ended
  and freed and the call fails with EnvironmentFailed (INTERNAL, never DEADLINE_EXCEEDED, which a
  caller would retry on the same turn); from then on the episode is NotFound, like an episode
  ended by `end` or reaped, and a start of its id starts afresh.
- An episode with no call for `lease_s` is reaped (`reap_idle`, run by `reap_forever`); an episode
  whose call is running is never idle.

A call that runs on in the instance is owned by the episode, not by the RPC that began it: a caller
that gave up (its deadline passed, its connection dropped) can retry and receive the same answer.
Plain methods run on worker threads (`calls.run_code`), each call on a thread no other call is
using, so a hung one holds only its thread (which cannot be stopped; it is abandoned when its time
limit passes, and `close` may run beside it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pipelinerl.common.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.environment.calls import run_code
from pipelinerl.environment.sdk import Environment
from pipelinerl.environment.types import (
    EnvironmentInfo,
    EnvironmentStats,
    EpisodeOpening,
    Message,
    StepResult,
)
from pipelinerl.environment.validation import (
    EnvironmentFailed,
    check_action,
    check_episode_id,
    check_opening,
    check_step,
    check_task,
    check_tools,
    check_turn,
)

log = get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class EpisodeLimits:
    """The server's limits on episodes (from `EnvironmentSettings`)."""

    max_episodes: int = 256
    lease_s: float = 600.0
    max_observation_bytes: int = 1024 * 1024
    step_timeout_s: float = 60.0


@dataclass
class _Episode:
    id: str
    seed: int
    task: str
    last_used: float
    env: Environment | None = None
    starting: asyncio.Task[EpisodeOpening] | None = None
    opening: EpisodeOpening | None = None
    turn: int = 0
    """The turn answered last; 0 before the first."""
    action: Message | None = None
    """The action of turn `turn`."""
    answer: StepResult | None = None
    pending: tuple[int, Message, asyncio.Task[StepResult]] | None = None
    """The turn being answered, its action, and the call."""

    @property
    def ended(self) -> bool:
        return self.answer is not None and self.answer.ended

    def busy(self) -> bool:
        return (self.starting is not None and not self.starting.done()) or self.pending is not None


@dataclass
class _Counts:
    started: int = 0
    steps: int = 0
    reaped: int = 0
    failures: int = 0


class EpisodeTable:
    """The episodes of one environment class; every method runs in the server's event loop."""

    def __init__(
        self,
        cls: type[Environment],
        env_args: dict[str, Any] | None = None,
        limits: EpisodeLimits | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        observe_step: Callable[[float], None] | None = None,
    ) -> None:
        self._cls = cls
        self._env_args = dict(env_args or {})
        self.limits = limits or EpisodeLimits()
        self._clock = clock
        self._observe_step = observe_step
        self._tools = check_tools(cls.tools, cls.__qualname__)
        self._episodes: dict[str, _Episode] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._counts = _Counts()
        self._draining = False

    @property
    def info(self) -> EnvironmentInfo:
        cls, limits = self._cls, self.limits
        return EnvironmentInfo(
            name=cls.display_name(),
            version=cls.version,
            description=cls.description,
            tools=self._tools,
            max_turns=cls.max_turns,
            max_episodes=limits.max_episodes,
            lease_s=limits.lease_s,
            max_observation_bytes=limits.max_observation_bytes,
        )

    @property
    def stats(self) -> EnvironmentStats:
        c = self._counts
        return EnvironmentStats(
            active_episodes=len(self._episodes),
            max_episodes=self.limits.max_episodes,
            episodes_started=c.started,
            steps=c.steps,
            episodes_reaped=c.reaped,
            failures=c.failures,
        )

    async def start(self, episode_id: str, seed: int, task: str) -> EpisodeOpening:
        check_episode_id(episode_id)
        check_task(task)
        episode = self._episodes.get(episode_id)
        if episode is not None:
            if (episode.seed, episode.task) != (seed, task):
                raise FailedPrecondition(
                    f"episode {episode_id} was started with seed {episode.seed} and another task or seed; "
                    "an id names one episode"
                )
            episode.last_used = self._clock()
            if episode.opening is not None:
                return episode.opening
            assert episode.starting is not None
            return await asyncio.shield(episode.starting)
        if self._draining:
            raise Unavailable("the server is draining; start the episode on another replica")
        if len(self._episodes) >= self.limits.max_episodes:
            raise ResourceExhausted(
                f"the server holds {len(self._episodes)} episodes, its max_episodes; end one or retry later"
            )
        episode = _Episode(episode_id, seed, task, last_used=self._clock())
        self._episodes[episode_id] = episode
        episode.starting = _owned(asyncio.create_task(self._open(episode), name=f"start {episode_id}"))
        return await asyncio.shield(episode.starting)

    async def _open(self, episode: _Episode) -> EpisodeOpening:
        cls, limits = self._cls, self.limits

        async def reset() -> Any:
            env: Environment = await run_code(lambda: cls(**self._env_args))
            episode.env = env
            return await run_code(env.reset, episode.seed, episode.task)

        try:
            opening = check_opening(
                await self._guarded("reset", reset),
                self._tools,
                cls.max_turns,
                limits.max_observation_bytes,
            )
        except EnvironmentFailed as exc:
            self._fail(episode, exc)
            raise
        finally:
            episode.last_used = self._clock()
        episode.opening = opening
        self._counts.started += 1
        return opening

    async def step(self, episode_id: str, turn: int, action: Message) -> StepResult:
        check_episode_id(episode_id)
        check_turn(turn)
        check_action(action)
        episode = self._held(episode_id)
        episode.last_used = self._clock()
        if episode.opening is None:
            assert episode.starting is not None
            await asyncio.shield(episode.starting)
        if episode.pending is not None and episode.pending[0] == turn:
            _, pending_action, call = episode.pending
            self._same_action(episode, turn, pending_action, action)
            return await asyncio.shield(call)
        if turn == episode.turn and episode.answer is not None:
            assert episode.action is not None
            self._same_action(episode, turn, episode.action, action)
            return episode.answer
        if episode.ended:
            assert episode.answer is not None
            how = "terminated" if episode.answer.terminated else "was truncated"
            raise FailedPrecondition(
                f"episode {episode_id} {how} at turn {episode.turn}; it takes no turn {turn}"
            )
        if turn != episode.turn + 1 or episode.pending is not None:
            raise FailedPrecondition(
                f"turn {turn} of episode {episode_id} is out of order: the last answered is {episode.turn}"
                + (f" and turn {episode.pending[0]} is being answered" if episode.pending else "")
            )
        call = _owned(
            asyncio.create_task(self._advance(episode, turn, action), name=f"step {episode_id} {turn}")
        )
        episode.pending = (turn, action, call)
        return await asyncio.shield(call)

    def _same_action(self, episode: _Episode, turn: int, answered: Message, action: Message) -> None:
        if answered != action:
            raise FailedPrecondition(
                f"turn {turn} of episode {episode.id} was answered for another action; a retry sends the same"
            )

    async def _advance(self, episode: _Episode, turn: int, action: Message) -> StepResult:
        began = time.monotonic()
        env = episode.env
        assert env is not None
        try:
            result = check_step(
                await self._guarded(f"step of turn {turn}", lambda: run_code(env.step, action)),
                action,
                turn,
                episode.opening.max_turns if episode.opening else 0,
                self.limits.max_observation_bytes,
            )
        except EnvironmentFailed as exc:
            episode.pending = None
            self._fail(episode, exc)
            raise
        finally:
            episode.last_used = self._clock()
        episode.turn, episode.action, episode.answer, episode.pending = turn, action, result, None
        self._counts.steps += 1
        if self._observe_step is not None:
            self._observe_step(time.monotonic() - began)
        if result.ended:
            self._close_soon(episode)
        return result

    async def _guarded(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """`call()` under the time limit, with any failure of the environment's code as EnvironmentFailed."""
        try:
            async with asyncio.timeout(self.limits.step_timeout_s):
                return await call()
        except TimeoutError as exc:
            limit = self.limits.step_timeout_s
            raise EnvironmentFailed(f"{what} ran past step_timeout_s ({limit} s)") from exc
        except Exception as exc:
            log.warning("environment code raised", call=what, exc_info=True)
            raise EnvironmentFailed(f"{what} raised {type(exc).__name__}: {exc}") from exc

    def _fail(self, episode: _Episode, exc: EnvironmentFailed) -> None:
        self._counts.failures += 1
        log.warning("episode failed", episode_id=episode.id, error=exc.message)
        if self._episodes.get(episode.id) is episode:
            del self._episodes[episode.id]
        self._close_soon(episode)

    def _held(self, episode_id: str) -> _Episode:
        episode = self._episodes.get(episode_id)
        if episode is None:
            raise NotFound(f"episode {episode_id} is not held: never started, ended, failed or reaped")
        return episode

    async def end(self, episode_id: str) -> None:
        """End the episode and close its instance; an episode not held is already ended."""
        check_episode_id(episode_id)
        episode = self._episodes.pop(episode_id, None)
        if episode is not None:
            self._close_soon(episode)

    def reap_idle(self) -> list[str]:
        """End every episode idle for its lease; returns their ids."""
        deadline = self._clock() - self.limits.lease_s
        idle = [e for e in self._episodes.values() if e.last_used <= deadline and not e.busy()]
        for episode in idle:
            del self._episodes[episode.id]
            self._counts.reaped += 1
            self._close_soon(episode)
        if idle:
            log.info("reaped idle episodes", count=len(idle), lease_s=self.limits.lease_s)
        return [e.id for e in idle]

    async def reap_forever(self) -> None:
        """Reap idle episodes until cancelled, checking a few times per lease."""
        interval = min(max(self.limits.lease_s / 4, 0.01), 1.0)
        while True:
            await asyncio.sleep(interval)
            self.reap_idle()

    def stop_starting(self) -> None:
        """Draining: new episodes are refused (Unavailable); held ones are still answered."""
        self._draining = True

    async def close(self) -> None:
        """End every episode and wait for their instances to close."""
        self.stop_starting()
        for episode in list(self._episodes.values()):
            self._close_soon(episode)
        self._episodes.clear()
        while self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def _close_soon(self, episode: _Episode) -> None:
        """Close the episode's instance once its running call, if any, has ended."""
        task = asyncio.create_task(self._close(episode), name=f"close {episode.id}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, episode: _Episode) -> None:
        running = [t for t in (episode.starting, episode.pending[2] if episode.pending else None) if t]
        if running:
            await asyncio.wait(running)
        env, episode.env = episode.env, None
        if env is None:
            return
        try:
            async with asyncio.timeout(self.limits.step_timeout_s):
                await run_code(env.close)
        except Exception:
            log.warning("closing an episode failed", episode_id=episode.id, exc_info=True)


def _owned(task: asyncio.Task[T]) -> asyncio.Task[T]:
    """`task`, whose failure is read by its callers; one whose every caller gave up is not logged
    as an exception nobody retrieved (the episode's own log line said what failed)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task
