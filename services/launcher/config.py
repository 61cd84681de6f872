"""Settings of `pipelinerl run` (env `PIPELINERL_RUN_*`, `--flags`, or a YAML/TOML file).

The sections `reward`, `trainer`, `inference` and `coordinator` are typed with each service's own
settings class, so a misspelt or ill-typed setting fails as the run's settings load, named by its
path (`trainer.learner.lr`). A section holds overrides only: the fields it gives are written, over
what the launcher fills in (ports, addresses, threads, the model and the run's other settings), into
the service's config file (`trainer: {learner: {lr: 1e-4}}`); the fields it omits keep those.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, FilePath, model_validator
from pydantic_settings import SettingsConfigDict

from pipelinerl.common.settings import LayeredSettings, ServiceSettings
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.coordinator.tasks import max_new_tokens
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.reward.config import RewardSettings
from pipelinerl.trainer.config import TrainerSettings

TURN_TOKENS = 40
"""Tokens per model turn of an episode when `max_new_tokens` is unset: room for a tool call of the
presets' template (`<call>add{"a":347,"b":582}</call>`) and its end."""


class RestartPolicy(BaseModel):
    """How `pipelinerl run` supervises the services it started: a service that exits, answers no
    health check for `unhealthy_after_s`, or answers NOT_SERVING for `not_serving_after_s`, is killed
    (by its handle) and started again on the ports it had, after a delay that doubles with each
    recent restart. More than `max_restarts`
    restarts of one service within `window_s` fail the run, naming the service and its last log lines."""

    model_config = ConfigDict(extra="forbid")

    max_restarts: int = Field(default=5, ge=0)
    """Restarts of one service allowed within `window_s`; 0 fails the run at the first death."""
    window_s: float = Field(default=600.0, gt=0)
    """The window `max_restarts` counts over (seconds)."""
    backoff_initial_s: float = Field(default=0.5, ge=0)
    """Delay before the first restart of a service within `window_s`; doubled for each further one."""
    backoff_max_s: float = Field(default=30.0, ge=0)
    """Longest delay before a restart."""
    health_every_s: float = Field(default=1.0, gt=0)
    """How often each service is checked: has it exited, does it answer its health check?"""
    unhealthy_after_s: float = Field(default=15.0, gt=0)
    """A service that has answered no health check for this long (frozen, deadlocked) is restarted."""
    not_serving_after_s: float = Field(default=60.0, gt=0)
    """A service that has answered NOT_SERVING for this long is restarted: a trainer or an engine
    that failed for good says so. Longer than `unhealthy_after_s`, since a service also says it
    while one it depends on is down (the coordinator without a reward replica), which its own
    restart would not mend."""


class RunSettings(LayeredSettings):
    """One local RL run: every service as a process on 127.0.0.1, driven to the end and stopped.
    A wrong setting stops it before anything starts, as one line `error: <setting>: <reason>`
    (exit status 2); `--debug` shows the traceback instead."""

    model_config = SettingsConfigDict(env_prefix="PIPELINERL_RUN_")

    mode: Literal["pipeline", "sync"] = "pipeline"
    """`pipeline`: generation and training overlap, weights update in flight. `sync`: the
    conventional baseline (generate a batch, score, train, publish, repeat) on the same services."""
    run_id: str = "run"
    """Id of the run in the coordinator's journal; the same id in the same run directory resumes it."""
    run_dir: Path = Field(default_factory=lambda: Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    """Where logs, the journal, checkpoints, metrics.jsonl and plot.png go (a new folder per run by
    default; pointing at an existing one resumes its run from the journal and checkpoint)."""
    dataset: str = "builtin:copy:2"
    """`builtin:<copy|reverse|sort>[:<digits>]`, `builtin:repeat[:<largest count>]` (long-tail
    completion lengths) or a local JSONL/parquet file."""
    model: str = "tiny"
    """Preset name or local HF directory, for the trainer and every inference server."""
    seed: int = 0
    """Seed of the preset's initial weights and of the prompt order."""
    group_size: int = Field(default=8, ge=2)
    """Attempts per prompt."""
    samples_per_step: int = Field(default=128, ge=1)
    """Samples per optimizer step (one new weight version each); in sync mode also the round size."""
    max_in_flight: int = Field(default=256, ge=2)
    """Attempts dispatched and not yet acknowledged by the trainer (pipeline mode); at least
    `samples_per_step`, or no step is ever full. Each inference server's window (`max_running`)
    is its share of these, unless its section sets one."""
    round_steps: int = Field(default=1, ge=1)
    """Sync mode: optimizer steps per generation round. 1 is the synchronous baseline (a round of
    `samples_per_step`, trained by one step on the version that generated it). Above 1 it is the
    conventional variant the PipelineRL paper compares against: a round of `round_steps ×
    samples_per_step` generated with one version, then as many steps, the later ones on samples
    1 to `round_steps - 1` versions old (keep it within the trainer's `max_lag` + 1)."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Most tokens per completion. Unset: a built-in task's longest answer plus end-of-sequence
    (3 for `builtin:copy:2`, 129 for `builtin:repeat`), and 3 for a file."""
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature."""
    lr: float = Field(default=3e-4, gt=0)
    """Learning rate of the trainer."""
    entropy_coef: float = Field(default=0.03, ge=0)
    """Weight of the trainer's entropy bonus (`learner.loss.entropy_coef`). Without it the tiny
    policy collapses onto fixed answers for most prompts (groups of equal rewards, entropy near 0)
    and the built-in task plateaus; docs/benchmarks.md has the comparison over seeds."""
    entropy_floor: float | None = Field(default=None, gt=0)
    """Nats per token (`learner.loss.entropy_floor`): when set, the bonus acts only on samples whose
    mean token entropy is below it, so it stops a collapse without pushing up the entropy of a
    policy that still explores. Unset: the bonus acts at every entropy. docs/benchmarks.md has the
    comparison over seeds."""
    max_samples: int = Field(default=0, ge=0)
    """Stop after this many samples have been trained on; 0 means until `duration_s`."""
    duration_s: float = Field(default=480.0, gt=0)
    """Wall-clock budget of the run (the run is stopped cleanly when it is spent)."""
    target_reward: float | None = None
    """Stop early once the mean reward reaches this."""
    environment: str | None = None
    """Train on the multi-turn episodes of this environment instead of `dataset`'s prompts: a
    built-in's name (`guess_number`, `calculator`, `frozen_lake`, `blackjack`), or
    `package.module:Class` / `path/to/file.py:Class` (docs/environments.md)."""
    agent: str | None = None
    """Train an agent that runs its own loop against a chat-completions endpoint instead: a
    built-in's name (`guess_number`, `calculator`), or `package.module:function` /
    `path/to/file.py:function` (docs/agents.md). The launcher hosts it (`environment_servers` agent
    hosts) and the coordinator serves the endpoint."""
    environment_args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment class (`--environment-args '{"high": 8}'`); an agent's
    `Episode.args`."""
    environment_servers: int = Field(default=1, ge=0)
    """Environment service processes (replicas); each episode goes to the least loaded one and stays.
    0: start none, and play on the replicas `coordinator: {environment_addresses: [...]}` names
    (an environment served apart, in any language); `environment` is then the name it describes
    itself with."""
    max_turns: int = Field(default=0, ge=0)
    """Most model turns per episode; 0: the environment's own limit."""
    eval: list[str] | None = None
    """Held-out sets evaluated while the run trains (the flag repeated for several):
    `builtin:<task>[:<size>]` (the task's held-out problems, never trained on), a JSONL/parquet file
    (the run's own file: its `eval_split` rows), or `environment` (held-out episodes of the run's
    environment). Unset: the run's own built-in task, none for a file or an environment;
    `--eval '[]'`: none. docs/evaluation.md."""
    eval_every: int = Field(default=16, ge=1)
    """Versions between two evaluations of a set (besides the first version and the last)."""
    eval_k: int = Field(default=1, ge=1)
    """Completions per evaluation problem: pass@k is reported for this k."""
    eval_temperature: float = Field(default=0.0, ge=0)
    """Sampling temperature of evaluations; 0 is greedy."""
    eval_limit: int = Field(default=0, ge=0)
    """Problems per evaluation; 0: every row of a file, 256 of a built-in task or environment."""
    eval_split: float = Field(default=0.0, ge=0, le=0.5)
    """Fraction of a file dataset's rows held out from training (chosen by `seed`) to evaluate."""
    epochs: int = Field(default=1, ge=1)
    """Passes over a file dataset, each in an order of its own (built-in tasks are endless)."""
    inference_servers: int = Field(default=1, ge=1)
    """Inference server processes that generate the attempts trained on."""
    eval_servers: int | None = Field(default=None, ge=0)
    """Inference servers of their own for held-out evaluation (`role: evaluation`): they follow the
    trainer's versions as the others do but take no attempt that is trained on, so an evaluation
    holds up no training server and takes none of its rows. On CPU they run niced, on the CPU time
    the others leave idle. Unset: one when the run evaluates with the built-in engine on CPU, none
    otherwise (evaluations then run on a training server, which holds its version meanwhile)."""
    reward_servers: int = Field(default=1, ge=1)
    """Reward service processes (replicas); the coordinator sends each Score call to the least
    loaded one, and to another if it fails there."""
    trainer_ranks: int = Field(default=1, ge=1)
    """Trainer processes. Above 1 the trainer runs the DeepSpeed ZeRO backend over that many ranks
    under torchrun (stage from `trainer: {zero: {stage: N}}`, 2 by default)."""
    engine: Literal["builtin", "vllm"] = "builtin"
    """Inference engine. `vllm` runs the inference servers with `vllm_python` (`make vllm-env`)."""
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    """`cpu`, or `cuda[:N]`: the trainer and every inference server on that one GPU, each version
    handed over by CUDA IPC (one device-to-device copy)."""
    vllm_python: Path = Path(".venv-vllm/bin/python")
    """Interpreter of the vLLM virtualenv (vLLM pins its own torch, so it lives apart)."""
    metrics: bool = True
    """Every service serves Prometheus metrics on a free port of 127.0.0.1; the addresses go to
    `<run_dir>/prometheus_targets.json`, a file_sd list a local Prometheus can scrape."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    """Every service's. `debug` adds a line per attempt in every service (what `pipelinerl trace`
    shows of it besides the journal's record): about 0.9 KB per trained sample."""
    pin_cores: bool = True
    """Pipeline mode on CPU: pin inference and trainer to separate cores (when there are enough)."""
    auth_token: str | None = None
    """Bearer token every service then requires (health checks excepted) and every client sends."""
    tls_cert_file: FilePath | None = None
    """PEM certificate, valid for 127.0.0.1, that every service serves TLS with (with `tls_key_file`)."""
    tls_key_file: FilePath | None = None
    """PEM private key of `tls_cert_file`."""
    tls_ca_file: FilePath | None = None
    """PEM CA bundle the clients verify the services with; unset, `tls_cert_file` (self-signed). With
    `coordinator_address`, set it alone to reach a coordinator that speaks TLS."""
    coordinator_address: str | None = None
    """`host:port` of a coordinator already running with its services (docker compose, a cluster):
    start the run there and follow it, starting no process. The service sections and the placement
    settings below then do not apply; the services' own settings do."""
    restart: RestartPolicy = Field(default_factory=RestartPolicy)
    """Supervision of the services: when one is restarted, and when the run gives up on it."""
    # An empty section (no field set) until the user gives one; see `overrides`.
    reward: RewardSettings = Field(default_factory=RewardSettings.model_construct)
    """Settings of the reward service, over the launcher's (defaults shown are the service's)."""
    trainer: TrainerSettings = Field(default_factory=TrainerSettings.model_construct)
    """Settings of the trainer, over the launcher's (e.g. `learner: {loss: {kind: ppo}}`)."""
    inference: InferenceSettings = Field(default_factory=InferenceSettings.model_construct)
    """Settings of every inference server, over the launcher's."""
    coordinator: CoordinatorSettings = Field(default_factory=CoordinatorSettings.model_construct)
    """Settings of the coordinator, over the launcher's."""

    @model_validator(mode="after")
    def _full_steps(self) -> Self:
        if self.mode == "pipeline" and self.max_in_flight < self.samples_per_step:
            raise ValueError(
                f"max_in_flight ({self.max_in_flight}) must be at least samples_per_step "
                f"({self.samples_per_step}): fewer attempts in flight never fill a step"
            )
        return self

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file must be set together")
        if self.tls_ca_file is not None and self.tls_cert_file is None and self.coordinator_address is None:
            raise ValueError("tls_ca_file needs tls_cert_file and tls_key_file, or coordinator_address")
        return self

    @model_validator(mode="after")
    def _one_kind_of_episode(self) -> Self:
        if self.environment is not None and self.agent is not None:
            raise ValueError("environment and agent are two kinds of run: set one")
        return self

    @property
    def episodic(self) -> bool:
        """The run plays episodes, of an environment or of an agent, instead of `dataset`'s prompts."""
        return self.environment is not None or self.agent is not None

    @property
    def completion_tokens(self) -> int:
        """`max_new_tokens`, or what the dataset (or one turn of an episode) needs when it is unset."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.episodic:
            return TURN_TOKENS
        return max_new_tokens(self.dataset) if self.dataset.startswith("builtin:") else 3

    @property
    def eval_sets(self) -> list[str]:
        """The held-out sets the run evaluates (`eval`, or its default)."""
        if self.eval is not None:
            return self.eval
        return [self.dataset] if not self.episodic and self.dataset.startswith("builtin:") else []

    @property
    def evaluation_servers(self) -> int:
        """`eval_servers`, or its default."""
        if self.eval_servers is not None:
            return self.eval_servers
        return int(bool(self.eval_sets) and self.engine == "builtin" and self.device == "cpu")

    @property
    def environment_class(self) -> str | None:
        """`environment` as the environment service's `env` setting: a bare name is a built-in's."""
        if self.environment is None or ":" in self.environment or self.environment_servers == 0:
            return self.environment
        return f"builtin:{self.environment}"

    @property
    def agent_function(self) -> str | None:
        """`agent` as the agent host's `agent` setting: a bare name is a built-in's."""
        if self.agent is None or ":" in self.agent or self.environment_servers == 0:
            return self.agent
        return f"builtin:{self.agent}"

    @property
    def client_ca_file(self) -> Path | None:
        """The CA that clients of this run verify the services with, if they speak TLS."""
        return self.tls_ca_file or self.tls_cert_file


def overrides(section: ServiceSettings) -> dict[str, Any]:
    """The fields of a service's section that were given (at any depth), as a config file holds them."""
    return section.model_dump(mode="json", exclude_unset=True)
