"""The coordinator core behind `CoordinatorCore`: runs by id, each driven by a `RunLoop` task.

StartRun is idempotent: a run id known to the journal resumes where it stopped (a stopped run,
or one cut short by a crash); a running one is returned as it is. A run is checked (its dataset
opens, the inference servers can serve its sampling) before the journal holds it, so a refused
StartRun leaves nothing behind and its id stays free. An environment run is checked too: a
replica of its environment is up, and the coordinator has a tokenizer to render its episodes with.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from functools import partial
from typing import TYPE_CHECKING, Any

from pipelinerl.common.errors import FailedPrecondition, InvalidArgument, NotFound
from pipelinerl.common.log import bind_context, get_logger
from pipelinerl.common.types import SamplingParams
from pipelinerl.coordinator.datasets import evaluation_problems, open_problems
from pipelinerl.coordinator.episode import EpisodeDriver
from pipelinerl.coordinator.eval_schedule import EvaluationSchedule
from pipelinerl.coordinator.evaluation import Evaluator, problems_outside_a_run
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.loop import RunLoop
from pipelinerl.coordinator.pool import InferencePool, ServerLimits
from pipelinerl.coordinator.replicas import ReplicaPool
from pipelinerl.coordinator.reward_pool import RewardPool
from pipelinerl.coordinator.submitter import TrainerSubmitter
from pipelinerl.coordinator.tasks import Problem
from pipelinerl.coordinator.types import EvaluationResult, EvaluationSpec, Mode, RunInfo, RunSpec, RunState
from pipelinerl.environment.client import EnvironmentClient

if TYPE_CHECKING:
    from pipelinerl.coordinator.gateway import AgentGateway

log = get_logger(__name__)

WATCH_EVERY_S = 1.0  # between two progress updates of a watch while the state stays the same
LIMITS_TIMEOUT_S = 10.0  # for the inference servers to connect and advertise their limits
ENVIRONMENT_TIMEOUT_S = 10.0  # for an environment replica to be up at StartRun


def spec_to_json(spec: RunSpec) -> dict[str, object]:
    data = dataclasses.asdict(spec)
    data["mode"] = spec.mode.value
    data["sampling"]["stop_token_ids"] = list(spec.sampling.stop_token_ids)
    data["sampling"]["stop"] = list(spec.sampling.stop)
    return data


def spec_from_json(data: Mapping[str, Any]) -> RunSpec:
    """The inverse of `spec_to_json`, from its decoded JSON."""
    evaluations = tuple(
        EvaluationSpec(**{**e, "sampling": _sampling_from_json(e["sampling"])})
        for e in data.get("evaluations", ())
    )
    fields = {
        **data,
        "sampling": _sampling_from_json(data["sampling"]),
        "mode": Mode(data["mode"]),
        "evaluations": evaluations,
    }
    return RunSpec(**fields)


def _sampling_from_json(data: Mapping[str, Any]) -> SamplingParams:
    return SamplingParams(
        **{**data, "stop_token_ids": tuple(data["stop_token_ids"]), "stop": tuple(data["stop"])}
    )


@dataclasses.dataclass
class _Run:
    run_id: str
    spec: RunSpec
    loop: RunLoop
    started_at: datetime
    state: RunState = RunState.RUNNING
    error: str = ""
    task: asyncio.Task[None] | None = None
    evaluated: tuple[EvaluationResult, ...] = ()
    """A run journaled as completed before a restart: its evaluations, read once (a run that goes
    on has them in its loop)."""
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    """Set, then replaced by a fresh one, at each change of `state`: a watcher that took it
    before reading the state wakes on any later change, however many watchers share it."""

    def set_state(self, state: RunState, error: str = "") -> None:
        self.state, self.error = state, error
        self.changed.set()
        self.changed = asyncio.Event()


class Coordinator:
    def __init__(
        self,
        journal: Journal,
        pool: InferencePool,
        reward: RewardPool,
        submitter: TrainerSubmitter,
        tokenizer: str | None = None,
        environments: ReplicaPool[EnvironmentClient] | None = None,
        evaluation_pool: InferencePool | None = None,
        gateway: AgentGateway | None = None,
    ) -> None:
        """`evaluation_pool`: the evaluation servers, which evaluate while one is connected;
        `gateway`: the chat-completions endpoint of agent runs."""
        self._journal = journal
        self._pool = pool
        self._evaluation_pool = evaluation_pool
        self._gateway = gateway
        self._reward = reward
        self._submitter = submitter
        self._tokenizer = tokenizer
        self._environments = environments
        self._runs: dict[str, _Run] = {}
        self._starting = asyncio.Lock()  # the checks of a start await: one start at a time

    async def close(self, timeout_s: float = 10.0) -> None:
        """Stop every run, letting attempts in flight finish for up to `timeout_s`; the journal
        keeps whatever did not, for the next StartRun."""
        running = [run_id for run_id, run in self._runs.items() if run.state is RunState.RUNNING]
        stopping = asyncio.gather(*(self.stop_run(run_id) for run_id in running))
        try:
            await asyncio.wait_for(stopping, timeout_s)
        except TimeoutError:
            log.warning("runs did not stop in time; the journal resumes them", runs=running)

    async def start_run(self, run_id: str, spec: RunSpec) -> RunInfo:
        async with self._starting:
            return await self._start_run(run_id, spec)

    async def _start_run(self, run_id: str, spec: RunSpec) -> RunInfo:
        run = self._runs.get(run_id)
        if run is not None and run.state in (RunState.RUNNING, RunState.STOPPING, RunState.COMPLETED):
            return self._info(run)  # nothing to start: the run is going, or done
        record = self._journal.get_run(run_id)
        if record is not None:
            spec = spec_from_json(record.spec)  # a resumed run keeps the spec it started with
        completed = record is not None and record.state == RunState.COMPLETED.value
        start = record.next_prompt if record else 0
        problems = (
            iter(())
            if completed
            else open_problems(
                spec.dataset,
                spec.seed,
                start,
                self._tokenizer,
                epochs=spec.epochs,
                eval_split=spec.eval_split,
            )
        )
        episodes = None
        evaluations = None
        if not completed:
            limits = await self._check_servable(spec)
            if spec.environment:
                episodes = await self._episode_driver(spec, limits)
            evaluations = self._evaluation_sets(spec, limits)
        if record is None:
            record = self._journal.create_run(run_id, spec_to_json(spec))
        elif not completed:
            self._journal.set_run_state(run_id, RunState.RUNNING.value)
        schedule = None
        if evaluations:
            evaluator = Evaluator(self._pool, self._reward, episodes, self._evaluation_pool)
            version = partial(getattr, self._submitter, "latest_version")
            schedule = EvaluationSchedule(run_id, evaluations, evaluator, self._journal, version)
        loop = RunLoop(
            run_id,
            spec,
            self._journal,
            self._pool,
            self._reward,
            self._submitter,
            problems,
            episodes,
            schedule,
        )
        run = _Run(run_id, spec, loop, datetime.fromtimestamp(record.started_at, UTC))
        self._runs[run_id] = run
        if completed:  # journaled as done before a restart: report it, start nothing
            run.evaluated = tuple(self._journal.evaluations(run_id))
            run.set_state(RunState.COMPLETED)
            return self._info(run)
        run.task = asyncio.create_task(self._drive(run))
        log.info("run started", run_id=run_id, dataset=spec.dataset, mode=spec.mode.value)
        return self._info(run)

    async def _episode_driver(self, spec: RunSpec, limits: ServerLimits) -> EpisodeDriver:
        """FailedPrecondition unless an environment replica that says it is `spec.environment` is up
        and the episodes can be rendered."""
        from pipelinerl.common.tokenizer import load_tokenizer
        from pipelinerl.coordinator.chat_render import ChatRenderer

        environments = self._environments
        if environments is None or not environments.members:
            raise FailedPrecondition("the coordinator has no environment replicas (environment_addresses)")
        if self._tokenizer is None:
            raise FailedPrecondition(
                "an environment run needs the coordinator's tokenizer (its chat template)"
            )
        try:
            await asyncio.wait_for(environments.wait_reachable(True), ENVIRONMENT_TIMEOUT_S)
            async with environments.reserve() as replica:
                info = await replica.client.describe(timeout_s=ENVIRONMENT_TIMEOUT_S)
        except TimeoutError:
            raise FailedPrecondition(
                f"no environment replica was up within {ENVIRONMENT_TIMEOUT_S:g}s"
            ) from None
        if info.name != spec.environment:
            raise FailedPrecondition(
                f"spec.environment is {spec.environment!r}, but the environment replicas serve {info.name!r}"
            )
        renderer = ChatRenderer(load_tokenizer(self._tokenizer))
        if not info.agent:
            return EpisodeDriver(spec, self._pool, environments, renderer, max_context=limits.max_context)
        if self._gateway is None:
            raise FailedPrecondition(
                f"{info.name!r} is an agent host; its runs need the coordinator's agent_gateway_port"
            )
        from pipelinerl.coordinator.agent_episode import AgentDriver

        return AgentDriver(
            spec,
            self._pool,
            environments,
            renderer,
            max_context=limits.max_context,
            gateway=self._gateway,
            model=self._gateway.model,
        )

    def _evaluation_sets(
        self, spec: RunSpec, limits: ServerLimits
    ) -> list[tuple[EvaluationSpec, list[Problem]]]:
        """Each evaluation set of `spec` with its problems; InvalidArgument for a set that cannot be
        read or that training draws from."""
        sets = []
        for index, evaluation in enumerate(spec.evaluations):
            name, field = evaluation.dataset, f"spec.evaluations[{index}]"
            if name.startswith("environment:") and name != f"environment:{spec.environment}":
                raise InvalidArgument.field(
                    f"{field}.dataset",
                    f"{name!r} is not this run's environment ({spec.environment or 'none'})",
                )
            limits.check_new_tokens(evaluation.sampling.max_new_tokens, f"{field}.sampling.max_new_tokens")
            problems = evaluation_problems(
                evaluation.dataset,
                run_dataset=spec.dataset,
                seed=spec.seed,
                eval_split=spec.eval_split,
                tokenizer=self._tokenizer,
                limit=evaluation.max_problems,
                field=f"{field}.dataset",
            )
            sets.append((evaluation, problems))
        return sets

    async def _check_servable(self, spec: RunSpec) -> ServerLimits:
        """InvalidArgument naming the field if the inference servers would refuse every attempt."""
        limits = await self._pool.limits(LIMITS_TIMEOUT_S)
        tokens = spec.sampling.max_new_tokens
        limits.check_new_tokens(tokens, "spec.sampling.max_new_tokens")
        if tokens >= limits.max_context:
            raise InvalidArgument.field(
                "spec.sampling.max_new_tokens",
                f"{tokens} leaves no room for a prompt in the context of {limits.max_context} tokens",
            )
        return limits

    def get_run(self, run_id: str) -> RunInfo:
        return self._info(self._run(run_id))

    async def evaluate(self, spec: EvaluationSpec) -> EvaluationResult:
        """`spec`'s set evaluated once, outside any run, on the evaluation servers (the training
        servers without them) at the newest version one of them holds; nothing journaled. Its
        request ids are its own, so it may run beside runs and other evaluations."""
        problems = problems_outside_a_run(spec, self._tokenizer)
        evaluator = Evaluator(self._pool, self._reward, evaluation_pool=self._evaluation_pool)
        return await evaluator.evaluate_once(
            spec, problems, f"evaluate-{uuid.uuid4().hex[:8]}", LIMITS_TIMEOUT_S
        )

    def runs(self) -> list[RunInfo]:
        """Every run this coordinator has started or resumed since it began."""
        return [self._info(run) for run in self._runs.values()]

    async def stop_run(self, run_id: str) -> RunInfo:
        run = self._run(run_id)
        if run.state.final:
            return self._info(run)
        run.set_state(RunState.STOPPING)
        await run.loop.stop()
        if run.task is not None:
            await asyncio.shield(run.task)
        return self._info(run)

    async def watch_run(self, run_id: str) -> AsyncIterator[RunInfo]:
        run = self._run(run_id)
        while True:
            changed = run.changed
            info = self._info(run)
            yield info
            # Ended or not as sent, not as it is now: the run may have ended while the watcher
            # read, and its final state must still go out as the last message.
            if info.state.final:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), WATCH_EVERY_S)

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            if self._journal.get_run(run_id) is not None:
                raise FailedPrecondition(
                    f"run {run_id!r} is in the journal but not running; StartRun resumes it"
                )
            raise NotFound(f"no run {run_id!r}")
        return run

    def _info(self, run: _Run) -> RunInfo:
        return RunInfo(
            run.run_id,
            run.spec,
            run.state,
            run.loop.progress(),
            run.started_at,
            run.error,
            run.loop.evaluations or run.evaluated,
        )

    async def _drive(self, run: _Run) -> None:
        bind_context(run=run.run_id)
        try:
            await run.loop.run()
            run.set_state(RunState.STOPPED if run.state is RunState.STOPPING else RunState.COMPLETED)
        except Exception as exc:
            log.exception("run failed", run_id=run.run_id)
            run.set_state(RunState.FAILED, str(exc))
        self._journal.set_run_state(run.run_id, run.state.value, run.error)
        log.info(
            "run ended", run_id=run.run_id, state=run.state.value, **dataclasses.asdict(run.loop.progress())
        )
