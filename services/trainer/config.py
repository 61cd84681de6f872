"""Settings of the trainer (env `PIPELINERL_TRAINER_*`, `--flags`, or a YAML/TOML file) and of its
learner (`LearnerConfig`: optimizer, loss, advantages; `ZeroConfig`). Free of torch, so checking a
configuration loads no model code.
"""

from __future__ import annotations

import enum
import uuid
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_settings import SettingsConfigDict

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.weights.settings import PublisherSettings


class LagPolicy(enum.StrEnum):
    DROP = "drop"
    """A sample older than `max_lag` is discarded (acked DROPPED, counted)."""
    WAIT = "wait"
    """The trainer does not outrun generation: it holds its next step (version v → v + 1) until it
    has admitted a sample with a token of version ≥ v + 1 − max_lag, i.e. until the inference servers
    have caught up. The held step fills the buffer, so SubmitSamples stops reading (backpressure)
    until fresh data arrives. A sample that is still over `max_lag` (a sequence that outlived that
    many versions) is kept, as with `reweight`. Needs max_lag ≥ 1; with a full buffer the trainer
    steps anyway (logged), so a stalled generator cannot deadlock it."""
    REWEIGHT = "reweight"
    """A sample older than `max_lag` is trained on anyway; the loss's truncated importance weight
    bounds its influence."""


class PolicyLossKind(enum.StrEnum):
    REINFORCE = "reinforce"
    """Truncated importance-sampled REINFORCE: -min(ratio, cap).detach() * A * logp (PipelineRL's default)."""
    PPO = "ppo"
    """PPO-clip with per-token ratios: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)."""
    GSPO = "gspo"
    """GSPO: one ratio per sequence, exp of the mean per-token log-ratio, clipped like PPO."""
    DECOUPLED = "decoupled"
    """AReaL's decoupled PPO: PPO-clip of current against the *proximal* policy (the weights at the
    start of the optimizer step), times the behaviour weight proximal / behaviour, detached; tokens
    whose behaviour weight exceeds `behaviour_cap` are left out of the loss instead of truncated.
    With one optimizer step per batch the proximal policy is the current one, so the clip never
    binds and the loss is the behaviour-weighted policy gradient with rejection."""


class TokenWeighting(enum.StrEnum):
    TOKEN = "token"
    """Mean over every model token of the optimizer step: long sequences weigh more."""
    SEQUENCE = "sequence"
    """Mean over each sequence's tokens, then mean over sequences: every sequence weighs the same."""
    SAMPLE_COUNT = "sample_count"
    """Sum over tokens divided by the number of samples in the step (PipelineRL's normalisation)."""


class LossConfig(BaseModel):
    """Which policy loss to optimise and how its per-token terms are weighted."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: PolicyLossKind = PolicyLossKind.REINFORCE
    """The policy-gradient objective."""
    ratio_cap: float = Field(default=1.2, gt=0)
    """REINFORCE only: importance weights above this are truncated to it. PipelineRL clamps at
    1 + epsilon_high = 1.2; larger values trust stale tokens more (less bias, more variance)."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO and decoupled: the ratio is clipped to [1 - clip_eps, 1 + clip_eps]."""
    behaviour_cap: float = Field(default=5.0, gt=1)
    """Decoupled only: tokens whose behaviour weight (proximal / behaviour) exceeds this are left
    out of the loss (AReaL's token-level rejection, `upper: 5.0` in its M2PO example)."""
    m2_threshold: float | None = Field(default=None, gt=0)
    """M2PO's second-moment trust region, any kind: within each micro-batch, the tokens with the
    largest squared log behaviour weight are left out of the loss until the mean over the rest is
    below this (the M2PO paper's 0.04). None turns it off."""
    max_token_lag: int | None = Field(default=None, ge=0)
    """Any kind: a model token sampled by weights more than this many versions older than the ones
    the step trains is left out of the loss, while the newer tokens of its sample still train (an
    episode's late turns, or the end of a long completion that outlived updates). The trainer's lag
    policy judges a sample whole, at its oldest token; this bound judges each token. None turns it
    off."""
    gspo_clip_low: float = Field(default=3e-4, gt=0, lt=1)
    """GSPO only: lower clip range of the sequence ratio (the GSPO paper's 3e-4)."""
    gspo_clip_high: float = Field(default=4e-4, gt=0)
    """GSPO only: upper clip range of the sequence ratio (the GSPO paper's 4e-4)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the k3 KL penalty to the frozen reference model; 0 needs no reference model."""
    entropy_coef: float = Field(default=0.0, ge=0)
    """Weight of the entropy bonus, subtracted from the loss: each sample's mean token entropy,
    averaged over the step's samples (it does not grow with completion length, whatever
    `weighting` is); 0 still reports entropy."""
    entropy_floor: float | None = Field(default=None, gt=0)
    """Nats per token. When set, the bonus acts only on the samples whose mean token entropy is below
    it: it keeps a policy from collapsing onto fixed answers without pushing up the entropy of one
    that is still exploring (where it competes with the reward for the step)."""
    entropy_floor_per: Literal["sample", "token"] = "sample"
    """What `entropy_floor` is compared with: a sample's mean token entropy, or each token's own
    (the bonus then acts on each token below the floor, whatever the rest of its sample does: a
    policy that has collapsed at one position, while another, free of consequence, still explores,
    is pushed where it collapsed)."""
    weighting: TokenWeighting = TokenWeighting.SAMPLE_COUNT
    """How per-token terms are averaged over the optimizer step."""
    max_log_ratio: float = Field(default=10.0, gt=0)
    """Every log-ratio (current vs behaviour, reference vs current) is clamped to ±this before exp,
    so a token the two models disagree on wildly cannot overflow float32 into inf/NaN (PipelineRL
    clamps its reference log-ratio at 10). Beyond the clamp a token's term has no gradient."""

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0


class Baseline(enum.StrEnum):
    MEAN = "mean"
    """The group's mean reward, the sample's own reward included (GRPO)."""
    LEAVE_ONE_OUT = "leave_one_out"
    """The mean reward of the *other* samples of the group (RLOO): unbiased, since a sample's
    baseline does not depend on its own reward."""


class AdvantageConfig(BaseModel):
    """How rewards become advantages."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    baseline: Baseline = Baseline.MEAN
    """What is subtracted from each reward."""
    scale_by_std: bool = False
    """Divide by the group's reward standard deviation (sample std, n - 1); PipelineRL leaves it off."""
    std_eps: float = Field(default=1e-6, gt=0)
    """Added to the std before dividing, so nearly-equal rewards do not blow up."""
    negative_weight: float = Field(default=1.0, ge=0, le=1)
    """What the advantages below zero are multiplied by: 1 is the policy gradient; 0 trains only on
    the attempts that did better than their group (filtered, advantage-weighted behaviour cloning).
    A negative advantage pushes its tokens' probability down, and a softmax hands what it takes to
    the tokens already likeliest (the "squeezing effect" of Ren & Sutherland, ICLR 2025): on a model
    learning from random weights that concentrates every group on one answer before the model has
    learnt to tell them apart (docs/environments.md, the calculator). Below 1 the gradient is no
    longer the policy gradient's; use it where the runs show the collapse."""
    skip_zero_variance: bool = True
    """Leave samples of groups whose rewards are all equal out of the loss (they are still counted)."""


class LearnerConfig(BaseModel):
    """The optimizer, the micro-batching and the loss of one learner."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=1e-6, gt=0)
    """AdamW learning rate (constant)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates."""
    eps: float = Field(default=1e-8, gt=0)
    """AdamW denominator epsilon."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW decoupled weight decay."""
    grad_clip: float | None = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this; None reports the norm without clipping."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    packing: bool = True
    """Run each micro-batch as one row of its real tokens, no padding: each distinct prompt once,
    each completion attending to its prompt and to itself (packing.py). False runs the padded
    path: prompts right-padded, then completion rows right-padded on the prompts' key/value cache.
    Both give the same loss, gradient and metrics (tests/unit/test_packing.py); packed is faster
    wherever lengths differ (docs/benchmarks.md)."""
    micro_batch_tokens: int = Field(default=8192, ge=1)
    """Token budget of one micro-batch. Packed: its real tokens, each distinct prompt once plus
    every completion token. Padded: padding included, its distinct prompts × the longest prompt
    plus its rows × the longest completion (batching.py)."""
    micro_batch_overhead_tokens: int = Field(default=128, ge=0)
    """Padded path only: what one more micro-batch costs, in padded tokens' worth of time: a step
    is split into more micro-batches only where that saves more padding than this (batching.py).
    On CPU a forward and backward pass costs about 100 tokens beyond its tokens (`tiny`); on a GPU,
    where a pass's fixed cost is larger beside a token's, a larger value keeps fewer, fuller
    micro-batches. A packed step has no padding to trade against: it is cut only by the budget."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature of the rollouts. Training logits are divided by it so that current and
    behaviour logprobs describe the same distribution (the inference server reports logprobs after
    temperature)."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy loss, KL and entropy terms and token weighting."""
    advantages: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """Baseline, std scaling and zero-variance handling."""


class ZeroConfig(BaseModel):
    """DeepSpeed settings of the trainer (`--backend deepspeed`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: int = Field(default=2, ge=1, le=3)
    """ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also parameters."""
    overrides: dict[str, Any] = {}
    """Extra DeepSpeed config keys, merged over the generated config (e.g. offload settings)."""


class TrackingConfig(BaseModel):
    """Where the trainer logs each step's metrics besides `metrics_file`: TensorBoard and W&B."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dir: Path = Path(".")
    """Folder of the tracking output: event files in `<dir>/tensorboard`, the W&B run in
    `<dir>/wandb`. `pipelinerl run` sets it to the run directory."""
    tensorboard: bool = False
    """Write every step's metrics as TensorBoard scalars (needs the `tensorboard` extra)."""
    wandb: Literal["off", "online", "offline"] = "off"
    """Log every step's metrics to Weights & Biases (needs the `wandb` extra): `online` streams
    them to the W&B server (`wandb login` or WANDB_API_KEY first), `offline` keeps the run on disk
    for `wandb sync <dir>/wandb/offline-run-*` later."""
    wandb_project: str = "pipelinerl"
    """W&B project of the run; the run is named after the trainer's `run_id`."""


class TrainerSettings(ServiceSettings, PublisherSettings):
    """The trainer: admits scored samples, takes optimizer steps, publishes every version. Each
    component takes its part: the training loop (`Trainer`) these settings, the publisher those of
    `PublisherSettings`, the learner `learner` and `zero`."""

    # Annotated, as BaseSettings and BaseModel (of PublisherSettings) declare it with different types.
    model_config: ClassVar[SettingsConfigDict] = SettingsConfigDict(env_prefix="PIPELINERL_TRAINER_")

    port: int = Field(default=50052, ge=0, le=65535)
    """Port to bind; 0 picks a free one."""
    run_id: str = Field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Names this training run; weight versions carry it so receivers never mix two runs."""
    model: str = "tiny"
    """A preset name (`tiny`) or a local HF model directory: the policy's initial weights (version 0)."""
    seed: int = 0
    """Seed of a preset's random initial weights (use the inference servers' seed)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Training dtype of the weights."""
    device: str = "cpu"
    """`cpu` or `cuda[:N]`."""
    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads for training; unset keeps torch's default."""
    samples_per_step: int = Field(default=64, ge=1)
    """Samples (whole groups) per optimizer step; each step publishes a new weight version."""
    max_lag: int = Field(default=4, ge=0)
    """Largest lag, in versions, of a sample's oldest token at admission."""
    lag_policy: LagPolicy = LagPolicy.DROP
    """What happens to a sample over `max_lag`."""
    max_buffered_samples: int = Field(default=1024, ge=1)
    """Admitted samples waiting for a step; beyond this, SubmitSamples stops reading (backpressure)."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Optimizer, micro-batching, loss and advantages."""

    backend: Literal["torch", "deepspeed"] = "torch"
    """`torch`: one process, AdamW. `deepspeed`: ZeRO over every rank of a torchrun world
    (`torchrun --nproc-per-node N -m pipelinerl.trainer --backend deepspeed`); rank 0 serves."""
    zero: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO stage and extra DeepSpeed config (`--backend deepspeed`)."""
    checkpoint_dir: Path | None = None
    """Where checkpoints go (`<dir>/latest`); the trainer resumes from it at start. Unset: no checkpoints."""
    checkpoint_every: int = Field(default=50, ge=1)
    """Save a checkpoint every this many versions."""
    metrics_file: Path | None = None
    """Append one JSON line of metrics per optimizer step here."""
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    """TensorBoard and W&B logging of every step (off by default)."""

    @model_validator(mode="after")
    def _wait_needs_lag(self) -> TrainerSettings:
        if self.lag_policy is LagPolicy.WAIT and self.max_lag < 1:
            raise ValueError(
                "lag_policy wait needs max_lag >= 1: version v + 1 cannot be generated before it exists"
            )
        return self
