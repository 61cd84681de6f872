"""The agent host: runs whole episodes of one agent function (`RunEpisode`), each under a time limit.

    run(call) ──► the agent's function(Episode(id, seed, task, base_url, api_key, model, args))
              ──► its reward (agent.outcome) ──► the answer

- An id the host runs, or has run, is FailedPrecondition: an episode is not run twice under one
  id (a caller runs a failed episode again under a new id and a new `base_url`, so that a call the
  transport retried cannot record a second agent into the first's episode).
- More than `max_episodes` at once is ResourceExhausted; while draining, Unavailable.
- The agent's code runs under `episode_timeout_s`. When it raises, runs past it, or returns no
  reward, the call fails with EnvironmentFailed (INTERNAL): never scored, the caller plays the
  episode again with the same seed.
- A call whose caller goes away (its deadline, its connection) cancels an `async` agent; a plain
  one's thread cannot be stopped and is abandoned.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelinerl.common.errors import FailedPrecondition, ResourceExhausted, Unavailable
from pipelinerl.common.log import get_logger
from pipelinerl.environment.agent import Episode, outcome
from pipelinerl.environment.calls import run_code
from pipelinerl.environment.types import AgentCall, AgentOutcome, EnvironmentInfo, EnvironmentStats
from pipelinerl.environment.validation import EnvironmentFailed, check_episode_id, check_task

log = get_logger(__name__)

REMEMBERED_IDS = 65536
"""Ids of finished episodes kept to refuse a second run under one id (the oldest are forgotten)."""


@dataclass(frozen=True)
class AgentLimits:
    max_episodes: int = 256
    episode_timeout_s: float = 600.0


class AgentHost:
    """The episodes of one agent function; every method runs in the server's event loop."""

    def __init__(
        self,
        name: str,
        agent: Callable[[Episode], Any],
        args: dict[str, Any] | None = None,
        limits: AgentLimits | None = None,
    ) -> None:
        self._name = name
        self._agent = agent
        self._args = dict(args or {})
        self.limits = limits or AgentLimits()
        self._running: set[str] = set()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._started = self._failures = 0
        self._draining = False

    @property
    def info(self) -> EnvironmentInfo:
        return EnvironmentInfo(
            name=self._name,
            version="0",
            description=(self._agent.__doc__ or "").strip().split("\n")[0],
            tools=(),
            max_turns=0,
            max_episodes=self.limits.max_episodes,
            lease_s=self.limits.episode_timeout_s,
            max_observation_bytes=0,
            agent=True,
        )

    @property
    def stats(self) -> EnvironmentStats:
        return EnvironmentStats(
            active_episodes=len(self._running),
            max_episodes=self.limits.max_episodes,
            episodes_started=self._started,
            steps=0,
            episodes_reaped=0,
            failures=self._failures,
        )

    async def run(self, call: AgentCall) -> AgentOutcome:
        check_episode_id(call.episode_id)
        check_task(call.task)
        if call.episode_id in self._seen:
            raise FailedPrecondition(f"episode {call.episode_id} was run already; run it under a new id")
        if self._draining:
            raise Unavailable("the host is draining; run the episode on another replica")
        if len(self._running) >= self.limits.max_episodes:
            raise ResourceExhausted(f"the host runs {len(self._running)} episodes, its max_episodes")
        self._seen[call.episode_id] = None
        if len(self._seen) > REMEMBERED_IDS:
            self._seen.popitem(last=False)
        self._running.add(call.episode_id)
        self._started += 1
        episode = Episode(
            call.episode_id, call.seed, call.task, call.base_url, call.api_key, call.model, self._args
        )
        try:
            result = outcome(await self._guarded(episode))
        except EnvironmentFailed as exc:
            self._failures += 1
            log.warning("agent episode failed", episode_id=call.episode_id, error=exc.message)
            raise
        finally:
            self._running.discard(call.episode_id)
        return result

    async def _guarded(self, episode: Episode) -> object:
        limit = self.limits.episode_timeout_s
        try:
            async with asyncio.timeout(limit):
                return await run_code(self._agent, episode)
        except TimeoutError as exc:
            raise EnvironmentFailed(f"the agent ran past episode_timeout_s ({limit} s)") from exc
        except Exception as exc:
            log.warning("agent code raised", episode_id=episode.id, exc_info=True)
            raise EnvironmentFailed(f"the agent raised {type(exc).__name__}: {exc}") from exc

    def stop_starting(self) -> None:
        """Draining: new episodes are refused (Unavailable); running ones go on."""
        self._draining = True
