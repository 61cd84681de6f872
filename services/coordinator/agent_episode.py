"""One episode of an agent that runs its own loop: the attempt of a group in an agent run.

    reserve an agent host (an environment replica whose DescribeEnvironment says `agent`)
    ─► open the episode at the gateway: a fresh key, `base_url = <gateway>/v1/episodes/<key>`
    ─► RunEpisode(id, the group's seed, base_url, key) ─► the agent's calls, each recorded:
         history rendered ─► continues the sample or starts a new one (EpisodeTokens.add_history)
         ─► generated on the episode's inference server (the first call's) ─► parsed into the answer
    ─► the rewards RunEpisode returns ─► the episode's samples, each with the whole episode's reward
    ─► the key closed: a later call with it is refused (404)

What the model sampled is recorded as sampled, with its logprobs and weight versions; what the
agent sends around it (its tool results, its user turns, the template's scaffolding) is context.
An agent that rewrites its history starts a new sample (`forks`); one that extends it continues
the sample (`continued`).

An episode whose host fails (the agent's code raised or ran past its limit, the host went away)
is played again from the start with the same seed, under a new key, by `EpisodeDriver.play`'s
retries; its record so far is dropped. Nothing reaches the journal before the episode is whole, so
a coordinator (and gateway) crash plays it again too.
"""

from __future__ import annotations

import asyncio
import dataclasses

from pipelinerl.common.errors import FailedPrecondition, PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.common.types import FinishReason, SamplingParams
from pipelinerl.coordinator.chat_render import ChatRenderer
from pipelinerl.coordinator.episode import (
    CORRECT,
    EnvironmentFailed,
    EpisodeDriver,
    EpisodeResult,
    Turns,
)
from pipelinerl.coordinator.episode_tokens import EpisodeTokens
from pipelinerl.coordinator.gateway import AgentGateway, CallCounts
from pipelinerl.coordinator.openai_api import Answer, ApiError, ChatRequest
from pipelinerl.coordinator.pool import InferencePool
from pipelinerl.coordinator.replicas import Replica, ReplicaPool
from pipelinerl.coordinator.types import RunSpec
from pipelinerl.environment.client import EnvironmentClient
from pipelinerl.environment.types import AgentCall, AgentOutcome
from pipelinerl.inference.types import GenerationRequest

log = get_logger(__name__)

AGENT_TIMEOUT_S = 900.0
"""Deadline of one RunEpisode: past an agent host's own limit on the agent (`episode_timeout_s`,
600 s by default), so that an agent that hangs is that host's INTERNAL, not a host set down."""


class AgentRecorder:
    """Records the calls of one episode into its samples; calls are answered one at a time."""

    def __init__(
        self,
        episode_id: str,
        renderer: ChatRenderer,
        pool: InferencePool,
        sampling: SamplingParams,
        *,
        max_context: int,
        model: str,
        counts: CallCounts,
        prefer: str = "",
        weight_version: int | None = None,
    ) -> None:
        """Calls generate on `pool` with the run's `sampling` and the request's fields; an
        evaluation's episode starts on server `prefer`, every token at `weight_version`, with the
        temperature and top_p of its `sampling`."""
        self._id = episode_id
        self._counts = counts
        self._renderer = renderer
        self._pool = pool
        self._default = sampling
        self._weight_version = weight_version
        self._max_context = max_context
        self._model = model
        self._lock = asyncio.Lock()
        self.tokens: EpisodeTokens | None = None
        self.server = prefer
        self.calls = self.tool_calls = self.prefill = 0

    async def complete(self, request: ChatRequest) -> Answer:
        """Generate the answer to `request`, recording its tokens; ApiError when it is refused."""
        async with self._lock:
            tokens = self._history(request)
            budget = tokens.max_new_tokens(request.max_new_tokens or self._default.max_new_tokens)
            if budget == 0:
                raise ApiError(
                    400,
                    f"the messages leave no room for a completion in a context of {self._max_context}",
                    "messages",
                    "context_length_exceeded",
                )
            prompt = tokens.token_ids
            generation = GenerationRequest(
                f"{self._id}-c{self.calls + 1}",
                prompt,
                self._sampling(request, budget),
                weight_version=self._weight_version,
                prompt_cache_key=self._id,
            )
            try:
                self.server, completion = await self._pool.generate(generation, prefer=self.server)
            except PipelineError as exc:
                status, kind = (
                    (400, "invalid_request_error")
                    if exc.code == "INVALID_ARGUMENT"
                    else (503, "server_error")
                )
                raise ApiError(status, exc.message, None, exc.code.lower(), kind) from exc
            turn = tokens.add_turn(completion.tokens, completion.finish_reason)
            self.calls += 1
            self.tool_calls += len(turn.message.tool_calls)
            self.prefill += len(prompt)
            texts = tuple(self._renderer.decode([t]) for t in completion.tokens.token_ids)
            return Answer(
                f"chatcmpl-{self._id}-{self.calls}",
                request.model or self._model,
                turn.message,
                completion.finish_reason,
                completion.tokens,
                texts,
                len(prompt),
                request.logprobs,
            )

    def _history(self, request: ChatRequest) -> EpisodeTokens:
        """The episode's tokens with the call's history appended (or a new sample started)."""
        try:
            if self.tokens is None:
                self.tokens = EpisodeTokens(
                    self._renderer, request.messages, request.tools, max_context=self._max_context
                )
            else:
                append = self.tokens.add_history(request.messages, request.tools)
                if append.fork is None:
                    self._counts.continued += 1
                else:
                    self._counts.new_samples += 1
                    log.debug("agent call starts a new sample", episode_id=self._id, where=append.fork.where)
        except Exception as exc:  # the template refused the messages (roles out of order, say)
            raise ApiError(
                400, f"the model's chat template cannot render the messages: {exc}", "messages"
            ) from exc
        return self.tokens

    def _sampling(self, request: ChatRequest, budget: int) -> SamplingParams:
        """The run's sampling with the request's fields; an evaluation keeps its temperature and top_p."""
        default = self._default
        fixed = self._weight_version is not None
        return dataclasses.replace(
            default,
            max_new_tokens=budget,
            temperature=default.temperature if fixed or request.temperature is None else request.temperature,
            top_p=default.top_p if fixed or request.top_p is None else request.top_p,
            stop=request.stop or default.stop,
        )


class AgentDriver(EpisodeDriver):
    """Plays an agent run's episodes: each one RunEpisode of an agent host, its calls recorded at
    `gateway`. Evaluations and retries are `EpisodeDriver.play`'s."""

    def __init__(
        self,
        spec: RunSpec,
        pool: InferencePool,
        hosts: ReplicaPool[EnvironmentClient],
        renderer: ChatRenderer,
        *,
        max_context: int,
        gateway: AgentGateway,
        model: str,
    ) -> None:
        super().__init__(spec, pool, hosts, renderer, max_context=max_context)
        self._gateway = gateway
        self._model = model

    async def _play_once(
        self, replica: Replica[EnvironmentClient], episode_id: str, seed: int, turns: Turns
    ) -> EpisodeResult:
        recorder = AgentRecorder(
            episode_id,
            self._renderer,
            turns.pool,
            turns.sampling,
            max_context=self._max_context,
            model=self._model,
            counts=self._gateway.counts,
            prefer=turns.prefer,
            weight_version=turns.weight_version,
        )
        with self._gateway.episode(recorder) as (base_url, key):
            call = AgentCall(episode_id, seed, "", base_url, key, self._model)
            try:
                outcome = await replica.client.run_episode(call, timeout_s=AGENT_TIMEOUT_S)
            except PipelineError as exc:  # "start": a full host is waited for, not counted
                raise EnvironmentFailed(exc, "start") from exc
        return self._result(recorder, outcome)

    def _result(self, recorder: AgentRecorder, outcome: AgentOutcome) -> EpisodeResult:
        tokens = recorder.tokens
        samples = [self._sample(s) for s in tokens.samples() if s.model_spans] if tokens else []
        if not samples:
            raise FailedPrecondition("the agent's episode ended without a model call to train on")
        assert tokens is not None
        correct = any(c.name == CORRECT and c.value >= 1.0 for c in outcome.rewards)
        return EpisodeResult(
            samples,
            outcome.reward,
            correct,
            FinishReason.LENGTH if outcome.truncated else FinishReason.STOP,
            recorder.server,
            turns=recorder.calls,
            tool_calls=recorder.tool_calls,
            forks=tokens.forks,
            prefill_tokens=recorder.prefill,
        )


def _generation_error(exc: PipelineError) -> ApiError:
    """A request the inference servers refuse is the caller's (400); any other failure is the
    server's (503, which OpenAI clients retry)."""
    if exc.code == "INVALID_ARGUMENT":
        return ApiError(400, exc.message, None, "invalid_argument")
    return ApiError(503, exc.message, None, exc.code.lower(), "server_error")
