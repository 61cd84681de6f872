"""The learner: one optimizer step per batch of scored samples, on a plain torch model.

    step(samples, current_version)
      │  check_samples: ids in the vocabulary, lengths within the context (see validation.py)
      ├─► compute_advantages ─► zero-variance groups left out
      ├─► plan_step ─► micro-batches within the token budget, StepTotals of the whole step
      │     for each micro-batch:
      │       forward, packed (default): one unpadded row, each distinct prompt once, each
      │         completion attending to its prompt and itself (packing.py)
      │       forward, padded: each distinct prompt once, then the completions on its key/value cache
      │         (a segmented sample's context tokens too: one causal sequence)
      │         ─► logits / temperature ─► float32 logprob of each completion token, entropy
      │       (reference model, no grad) ─► reference logprobs, when KL is on
      │       policy_loss over model tokens (normalised by StepTotals) ─► backward: gradients accumulate
      ├─► clip grad norm ─► AdamW step            (the caller turns this into version + 1;
      │                                             skipped when the loss or the norm is not finite)
      └─► StepMetrics: reward, advantage, loss, grad norm, clip fraction, ESS, KL, entropy, lag, timing

    weights_for_publish() ─► name -> tensor, the names of model.named_parameters()
    save_checkpoint(dir) / load_checkpoint(dir): one checkpoint folder (see checkpoint.py)

`Learner` is the interface the trainer service drives; `DeepSpeedLearner` (deepspeed_learner.py)
implements it over a world of ZeRO ranks by overriding the hooks marked below.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pipelinerl.common.log import get_logger
from pipelinerl.common.types import Sample
from pipelinerl.trainer.advantages import GroupAdvantages, compute_advantages
from pipelinerl.trainer.batching import MicroBatch, StepPlan, plan_step
from pipelinerl.trainer.checkpoint import (
    load_optimizer,
    load_weights,
    read_trainer_state,
    save_optimizer,
    save_weights,
    write_trainer_state,
)
from pipelinerl.trainer.config import LearnerConfig
from pipelinerl.trainer.lineage import Lost, lineage_lag
from pipelinerl.trainer.losses import LossInputs, LossStats, entropy_from_logits, policy_loss
from pipelinerl.trainer.packing import packed_logits, use_packed_attention
from pipelinerl.trainer.validation import SampleLimits, check_samples
from pipelinerl.weights.buckets import TensorSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = get_logger(__name__)


@dataclass(frozen=True)
class StepMetrics:
    """What one call to `step` did. Means are over trained samples/tokens unless named otherwise."""

    stepped: bool
    """False when nothing was trained (every group had zero variance, or the gradient was not finite):
    the weights did not change and no new version should be published."""
    samples: int
    trained_samples: int
    groups: int
    zero_variance_groups: int
    reward_mean: float
    """Over every sample passed in, trained or not."""
    reward_std: float
    advantage_mean: float
    advantage_std: float
    loss: float
    grad_norm: float
    """Global gradient norm before clipping."""
    clip_fraction: float
    mean_ratio: float
    ess: float
    kl: float | None
    """Mean k3 KL to the reference model; None without one."""
    entropy: float | None
    lag_histogram: dict[int, int]
    """current_version minus the token's version -> number of model tokens."""
    tokens: int
    """Prompt and completion tokens trained on (context tokens included: they are run)."""
    completion_tokens: int
    """Model tokens trained on: what the loss sees."""
    micro_batches: int
    tokens_per_s: float
    prepare_s: float
    """Advantages and packing."""
    forward_backward_s: float
    optimizer_s: float
    """Gradient clipping and the optimizer step."""
    total_s: float


class Learner(Protocol):
    """What the trainer service needs from a training backend."""

    limits: SampleLimits
    """What a sample may hold for `step` to take it; the trainer checks samples against it on arrival."""

    def step(self, samples: Sequence[Sample], current_version: int, lost: Lost = ()) -> StepMetrics:
        """One optimizer step on `samples` (whole groups), trained while the weights are at
        `current_version`; `lost`, the versions restarts lost, for each token's lag (lineage.py)."""
        ...

    def weights_for_publish(self) -> Mapping[str, torch.Tensor] | TensorSource:
        """Current weights under the inference model's parameter names, read before the next `step`."""
        ...

    def save_checkpoint(
        self, directory: str | Path, version: int, extra_state: Mapping[str, Any] | None = None
    ) -> Path:
        """Write model, optimizer state, version and `extra_state` (JSON-serialisable) to `directory`."""
        ...

    def load_checkpoint(self, directory: str | Path) -> int:
        """Restore model and optimizer state from `directory`; returns the version saved there."""
        ...

    def close(self) -> None:
        """Release what the backend holds (other ranks, process groups)."""
        ...


class TorchLearner:
    """A `Learner` for any HF causal LM on one device, with AdamW."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: LearnerConfig | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        reference: PreTrainedModel | None = None,
    ) -> None:
        """`tokenizer` is saved with checkpoints so they load as a complete HF directory. `reference`
        is the frozen model of the KL term; when KL is on and none is given, a copy of `model` as it
        is now serves."""
        self.model = model
        self.config = config or LearnerConfig()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        if self.config.packing:
            use_packed_attention(model)
        self.reference: PreTrainedModel | None = None
        if self.config.loss.needs_reference:
            self.reference = _frozen(copy.deepcopy(model) if reference is None else reference)
            if self.config.packing:
                use_packed_attention(self.reference)
        if self.config.gradient_checkpointing:
            _enable_activation_checkpointing(model)
        self._build_optimizer()
        self._pad_token_id = _pad_token_id(model)
        context = getattr(model.config, "max_position_embeddings", None) or math.inf
        self.limits = SampleLimits(
            vocab_size=min(model.config.vocab_size, model.get_input_embeddings().num_embeddings),
            max_tokens=int(min(context, self.config.micro_batch_tokens)),
        )

    # ---- training ----------------------------------------------------------------------------

    def step(self, samples: Sequence[Sample], current_version: int, lost: Lost = ()) -> StepMetrics:
        started = time.perf_counter()
        check_samples(samples, self.limits)
        groups = compute_advantages(samples, self.config.advantages)
        trained = groups.trained(samples)
        # Each token's lag is worked out only for the loss that reads it (a Python pass per token).
        lag_from = current_version if self.config.loss.max_token_lag is not None else None
        plan = self._plan(trained, groups.advantages, lag_from, lost)
        prepared = time.perf_counter()

        self._zero_grad()
        stats = self.accumulate_gradients(plan) if trained else LossStats()
        backward_done = time.perf_counter()

        grad_norm, stepped = self._optimizer_step(stats.loss) if trained else (0.0, False)
        finished = time.perf_counter()

        tokens = sum(batch.tokens for batch in plan.micro_batches)
        metrics = StepMetrics(
            stepped=stepped,
            samples=len(samples),
            trained_samples=len(trained),
            groups=groups.groups,
            zero_variance_groups=groups.zero_variance_groups,
            **_reward_and_advantage_stats(samples, trained, groups),
            loss=stats.loss,
            grad_norm=grad_norm,
            clip_fraction=stats.clip_fraction,
            mean_ratio=stats.mean_ratio,
            ess=stats.ess,
            kl=stats.kl,
            entropy=stats.entropy,
            lag_histogram=lag_histogram(trained, current_version, lost),
            tokens=tokens,
            completion_tokens=plan.totals.completion_tokens,
            micro_batches=len(plan.micro_batches),
            tokens_per_s=tokens / max(finished - started, 1e-9),
            prepare_s=prepared - started,
            forward_backward_s=backward_done - prepared,
            optimizer_s=finished - backward_done,
            total_s=finished - started,
        )
        # The trainer service logs each step with its version; this line is for debugging the learner.
        log.debug(
            "train step",
            version=current_version,
            stepped=stepped,
            samples=len(samples),
            trained=len(trained),
            reward=round(metrics.reward_mean, 4),
            loss=round(stats.loss, 6),
            grad_norm=round(grad_norm, 4),
            tokens_per_s=round(metrics.tokens_per_s, 1),
        )
        return metrics

    def accumulate_gradients(self, plan: StepPlan) -> LossStats:
        """Forward and backward every micro-batch of `plan`, adding into the parameters' `.grad`.

        Each micro-batch's loss is already its share of the step loss, so the accumulated gradient
        is the gradient of the whole step however it was split.
        """
        self.model.train()
        stats = LossStats()
        try:
            for batch in plan.micro_batches:
                output = policy_loss(self._loss_inputs(batch.to(self.device)), self.config.loss, plan.totals)
                output.loss.backward()
                stats += output.stats
        finally:
            self.model.eval()
        return stats

    def _loss_inputs(self, batch: MicroBatch) -> LossInputs:
        if batch.packed is not None:
            return self._packed_loss_inputs(batch)
        temperature = self.config.temperature
        # Activation checkpointing drops the key/value cache, so the prompt cannot be run apart.
        shared = not self.config.gradient_checkpointing
        logits = completion_logits(self._forward_model, batch, temperature, shared_prompts=shared)
        # Entropy is always reported, but only needs a graph when it is part of the loss.
        with torch.set_grad_enabled(self.config.loss.entropy_coef > 0):
            entropy = entropy_from_logits(logits)
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference_logits = completion_logits(self.reference, batch, temperature, shared_prompts=True)
                reference = gather_logprobs(reference_logits, batch.completion_ids)
        return LossInputs(
            logprobs=gather_logprobs(logits, batch.completion_ids),
            behaviour_logprobs=batch.behaviour_logprobs,
            advantages=batch.advantages,
            mask=batch.loss_mask,
            reference_logprobs=reference,
            entropy=entropy,
            token_lag=batch.token_lag,
        )

    def _packed_loss_inputs(self, batch: MicroBatch) -> LossInputs:
        """`_loss_inputs` of a packed micro-batch: logits only where a completion token is predicted,
        logprobs and entropy there, then placed on the padded grid the loss reads."""
        layout = batch.packed
        assert layout is not None
        targets = batch.completion_ids[batch.completion_mask]  # row-major, as layout.predicting
        logits = packed_logits(self._forward_model, layout, self.config.temperature)
        with torch.set_grad_enabled(self.config.loss.entropy_coef > 0):
            entropy = layout.place(entropy_from_logits(logits))
        reference = None
        if self.reference is not None:
            with torch.no_grad():
                reference_logits = packed_logits(self.reference, layout, self.config.temperature)
                reference = layout.place(gather_logprobs(reference_logits, targets))
        return LossInputs(
            logprobs=layout.place(gather_logprobs(logits, targets)),
            behaviour_logprobs=batch.behaviour_logprobs,
            advantages=batch.advantages,
            mask=batch.loss_mask,
            reference_logprobs=reference,
            entropy=entropy,
            token_lag=batch.token_lag,
        )

    # ---- hooks a distributed backend overrides --------------------------------------------------

    def _build_optimizer(self) -> None:
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
            # One kernel for every parameter instead of a dozen ops each: 2.1 → 0.5 ms a step on `tiny`.
            fused=self.device.type in ("cpu", "cuda"),
        )

    def _plan(
        self, trained: Sequence[Sample], advantages: Mapping[str, float], version: int | None, lost: Lost = ()
    ) -> StepPlan:
        return plan_step(
            trained,
            advantages,
            self.config.micro_batch_tokens,
            self._pad_token_id,
            overhead_tokens=self.config.micro_batch_overhead_tokens,
            packed=self.config.packing,
            version=version,
            lost=lost,
        )

    @property
    def _forward_model(self) -> torch.nn.Module:
        return self.model

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self, loss: float) -> tuple[float, bool]:
        """Clip and step; a non-finite loss or gradient skips the step so one bad batch cannot ruin
        the weights."""
        max_norm = self.config.grad_clip or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            log.warning(
                "non-finite loss or gradient norm; optimizer step skipped", loss=loss, grad_norm=grad_norm
            )
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, False
        self.optimizer.step()
        return grad_norm, True

    # ---- weights and checkpoints -------------------------------------------------------------

    def weights_for_publish(self) -> Mapping[str, torch.Tensor] | TensorSource:
        """Detached views of the live parameters (no copy): read them before the next `step`."""
        return {name: param.detach() for name, param in self.model.named_parameters()}

    def save_checkpoint(
        self, directory: str | Path, version: int, extra_state: Mapping[str, Any] | None = None
    ) -> Path:
        """Write a whole checkpoint into `directory` (the trainer makes it the latest once written:
        see `CheckpointDir.save`)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._write_checkpoint(directory)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(directory)
        write_trainer_state(directory, version, extra_state)
        log.info("checkpoint saved", directory=str(directory), version=version)
        return directory

    def load_checkpoint(self, directory: str | Path) -> int:
        directory = Path(directory)
        state = read_trainer_state(directory)
        self._read_checkpoint(directory)
        log.info("checkpoint loaded", directory=str(directory), version=state.version)
        return state.version

    def close(self) -> None:
        """Nothing to release on one device."""

    def _write_checkpoint(self, staging: Path) -> None:
        """Model (HF safetensors) and optimizer state into `staging`."""
        save_weights(self.model, staging)
        save_optimizer(self.optimizer, staging)

    def _read_checkpoint(self, directory: Path) -> None:
        load_weights(self.model, directory, self.device)
        load_optimizer(self.optimizer, directory, self.device)


def completion_logits(
    model: torch.nn.Module, batch: MicroBatch, temperature: float, *, shared_prompts: bool
) -> torch.Tensor:
    """Float32 logits [rows, completion positions, vocabulary] divided by `temperature`: position t
    predicts completion token t, from the prompt's last token (t = 0) or completion token t - 1.

    `shared_prompts` runs each distinct prompt once and every completion row on its prompt's
    key/value cache, which autograd carries back into the prompt's pass. Without it, each row runs
    its prompt and completion in one pass (what activation checkpointing needs). Both read the
    same rows, gap included: a row is its prompt, the prompt's padding (masked), its completion.
    The last completion column is never an input: what it would predict lies past every completion,
    and causal attention lets no earlier position see it (on 3-token answers, a third of the rows'
    tokens).
    """
    rows = batch.row_prompt
    prompt_lengths = batch.prompt_lengths[rows]
    prompt_width = batch.prompt_ids.shape[1]
    inputs = batch.completion_ids[:, :-1]
    prompt_positions = torch.arange(prompt_width, device=rows.device)
    completion_positions = prompt_lengths[:, None] + torch.arange(inputs.shape[1], device=rows.device)
    attention_mask = torch.cat([batch.prompt_mask[rows], batch.completion_mask[:, :-1].long()], dim=1)
    if shared_prompts:
        prompts = model(
            input_ids=batch.prompt_ids,
            attention_mask=batch.prompt_mask,
            position_ids=prompt_positions.expand_as(batch.prompt_ids),
            use_cache=inputs.shape[1] > 0,
        )
        first = prompts.logits[rows, prompt_lengths - 1]
        if inputs.shape[1] == 0:  # one-token completions: the prompts' logits are all there is
            return first[:, None].float() / temperature
        # transformers 5 renamed `past_key_values` to `cache`; the output names it as the input does.
        cache_argument = "cache" if "cache" in prompts else "past_key_values"
        cache = prompts[cache_argument]
        cache.reorder_cache(rows)  # one cache row per completion row, an indexed copy autograd follows
        rest = model(
            input_ids=inputs,
            attention_mask=attention_mask,
            position_ids=completion_positions,
            use_cache=True,
            **{cache_argument: cache},
        ).logits
    else:
        logits = model(
            input_ids=torch.cat([batch.prompt_ids[rows], inputs], dim=1),
            attention_mask=attention_mask,
            position_ids=torch.cat([prompt_positions.expand(len(rows), -1), completion_positions], dim=1),
            use_cache=False,
        ).logits
        first = logits[torch.arange(len(rows), device=rows.device), prompt_lengths - 1]
        rest = logits[:, prompt_width:]
    return torch.cat([first[:, None], rest], dim=1).float() / temperature


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Logprob of each target under softmax(logits); gather minus logsumexp, which avoids
    materialising a second [rows, positions, vocab] tensor the way log_softmax would."""
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(dim=-1)


def lag_histogram(samples: Sequence[Sample], current_version: int, lost: Lost = ()) -> dict[int, int]:
    """How many model tokens were generated how many optimizer steps ago (only they carry versions)."""
    counts = Counter(
        lineage_lag(v, current_version, lost) for sample in samples for v in sample.completion.versions
    )
    return dict(sorted(counts.items()))


def _reward_and_advantage_stats(
    samples: Sequence[Sample], trained: Sequence[Sample], groups: GroupAdvantages
) -> dict[str, float]:
    rewards = [sample.reward for sample in samples]
    advantages = [groups.advantages[sample.sample_id] for sample in trained]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "reward_std": statistics.pstdev(rewards) if rewards else 0.0,
        "advantage_mean": statistics.fmean(advantages) if advantages else 0.0,
        "advantage_std": statistics.pstdev(advantages) if advantages else 0.0,
    }


def _frozen(model: PreTrainedModel) -> PreTrainedModel:
    model.requires_grad_(False)
    return model.eval()


def _pad_token_id(model: PreTrainedModel) -> int:
    # Right padding is never attended to by real tokens, so any id works; the model's pad id reads best.
    pad = model.config.pad_token_id
    if pad is None:
        pad = model.config.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    return int(pad or 0)


def _enable_activation_checkpointing(model: PreTrainedModel) -> None:
    model.config.use_cache = False
    # Non-reentrant checkpointing works with inputs that do not require grad (token ids).
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed the method and deprecated the old name, which 4.x still needs.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
