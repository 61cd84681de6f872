"""The DeepSpeed ZeRO backend (stages 1–3): one learner spread over the ranks of a torchrun world.

    torchrun --nproc-per-node N -m pipelinerl.trainer --backend deepspeed --zero.stage 3
      rank 0     the trainer service; each collective call of its learner is first sent to the others
      rank 1..   follow(): receive a call, run it on their shard, until rank 0 closes

    step(samples)        every rank gets all samples ─► same advantages and plan (deterministic)
                         ─► micro-batches[rank::world], padded with zero-weighted replays so every
                         rank runs as many forward/backward passes (ZeRO's collectives need it)
                         ─► engine.step() at the accumulation boundary
    weights_for_publish  stages 1–2: the live parameters (replicated); stage 3: a TensorSource
                         that gathers one parameter at a time on every rank as rank 0 packs it
    checkpoints          rank 0: HF safetensors (gathered one parameter at a time), tokenizer,
                         trainer_state.json; every rank: its optimizer partition (DeepSpeed format)

Gradients: each micro-batch's loss is its share of the whole step's loss (see batching.py) and
DeepSpeed averages gradients over ranks, so losses are scaled by the world size; the accumulated
gradient equals the single-process one. Calls happen one at a time (the trainer awaits each), so
the ranks never disagree on the order of collectives.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from pipelinerl.common.log import get_logger
from pipelinerl.common.types import Sample
from pipelinerl.trainer.batching import StepPlan, plan_step
from pipelinerl.trainer.checkpoint import save_weights
from pipelinerl.trainer.config import LearnerConfig, ZeroConfig
from pipelinerl.trainer.learner import StepMetrics, TorchLearner
from pipelinerl.trainer.lineage import Lost
from pipelinerl.trainer.losses import LossStats, policy_loss
from pipelinerl.weights.buckets import TensorSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = get_logger(__name__)

DEEPSPEED_DIR = "deepspeed"
_TAG = "state"
# Followers wait on rank 0 between calls for as long as the trainer waits for samples.
_CALL_TIMEOUT = timedelta(days=30)


class DeepSpeedLearner(TorchLearner):
    """A `Learner` on every rank of the default process group; rank 0's calls drive the others."""

    def __init__(
        self,
        model: PreTrainedModel,
        config: LearnerConfig | None = None,
        zero: ZeroConfig | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        self.zero = zero or ZeroConfig()
        config = config or LearnerConfig()
        if self.zero.stage == 3 and config.loss.needs_reference:
            raise ValueError(
                "the KL term needs a reference model, which ZeRO-3 does not shard yet; use stage 1 or 2"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Every rank is a member, so this is a group, never new_group's non-member sentinel.
        self._calls = cast(dist.ProcessGroup, dist.new_group(backend="gloo", timeout=_CALL_TIMEOUT))
        super().__init__(model, config, tokenizer=tokenizer)

    # ---- rank 0 drives, the others follow -----------------------------------------------------

    def follow(self) -> None:
        """On ranks other than 0: run rank 0's calls until it closes."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self._calls)
            name, args = box[0]
            if name == "close":
                self._leave()
                return
            try:
                result = getattr(self, name)(*args)
            except Exception:
                # Rank 0 met the same error: the checks that raise run before any collective and
                # are the same on every rank. Keep following, as rank 0 keeps serving.
                log.exception("call failed", call=name)
                continue
            if isinstance(result, Iterator):  # a parameter gather: take part, keep nothing
                for _ in result:
                    pass

    def _send(self, name: str, *args: Any) -> None:
        if self.rank == 0:
            dist.broadcast_object_list([(name, args)], src=0, group=self._calls)

    def step(self, samples: Sequence[Sample], current_version: int, lost: Lost = ()) -> StepMetrics:
        self._send("step", list(samples), current_version, list(lost))
        return super().step(samples, current_version, lost)

    def weights_for_publish(self) -> Mapping[str, torch.Tensor] | TensorSource:
        if self.zero.stage < 3:
            return super().weights_for_publish()
        return _GatheredParameters(self)

    def save_checkpoint(
        self, directory: str | Path, version: int, extra_state: Mapping[str, Any] | None = None
    ) -> Path:
        self._send("save_checkpoint", directory, version, None)  # extra_state is rank 0's to write
        if self.rank != 0:
            self._write_checkpoint(Path(directory))
            return Path(directory)
        return super().save_checkpoint(directory, version, extra_state)

    def load_checkpoint(self, directory: str | Path) -> int:
        self._send("load_checkpoint", directory)
        return super().load_checkpoint(directory)

    def close(self) -> None:
        self._send("close")
        self._leave()

    def _leave(self) -> None:
        """Every rank, once it has closed: wait for the others, then take the process groups down
        before the process exits (a rank exiting with gloo's threads alive could abort with
        `terminate called without an active exception`)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- the hooks of TorchLearner --------------------------------------------------------------

    def _build_optimizer(self) -> None:
        """The engine holds the ZeRO optimizer and steps it; `self.optimizer` is left unset."""
        import deepspeed

        # Without model_parameters DeepSpeed optimizes all of the model's parameters.
        self.engine, _, _, _ = deepspeed.initialize(model=self.model, config=self._deepspeed_config())

    def _deepspeed_config(self) -> dict[str, Any]:
        dtype = next(self.model.parameters()).dtype
        return {
            # One "micro-batch" per engine step: the learner accumulates over its own micro-batches and
            # marks the boundary itself.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": self.zero.stage},
            "optimizer": {
                "type": "AdamW",
                "params": {
                    "lr": self.config.lr,
                    "betas": list(self.config.betas),
                    "eps": self.config.eps,
                    "weight_decay": self.config.weight_decay,
                    "torch_adam": True,  # torch.optim.AdamW: no CUDA/C++ op to build
                },
            },
            "gradient_clipping": self.config.grad_clip or 0.0,
            # A non-finite gradient skips the step (fp32 always does, see _optimizer_step).
            "bf16": {"enabled": dtype == torch.bfloat16, "check_grad_overflow": True},
            "steps_per_print": 2**31 - 1,
            **self.zero.overrides,
        }

    def _plan(
        self, trained: Sequence[Sample], advantages: Mapping[str, float], version: int | None, lost: Lost = ()
    ) -> StepPlan:
        """Halve the token budget until every rank has a micro-batch of its own (when there are
        enough samples), so that the ranks share the work."""

        def within(budget: int) -> StepPlan:
            overhead, packed = self.config.micro_batch_overhead_tokens, self.config.packing
            return plan_step(
                trained,
                advantages,
                budget,
                self._pad_token_id,
                overhead_tokens=overhead,
                packed=packed,
                version=version,
                lost=lost,
            )

        budget = self.config.micro_batch_tokens
        plan = within(budget)
        # Never below the longest sample, which would no longer fit a micro-batch.
        longest = max((len(s.prompt_token_ids) + len(s.completion) for s in trained), default=budget)
        while len(plan.micro_batches) < min(self.world_size, len(trained)) and budget > longest:
            budget = max(budget // 2, longest)
            plan = within(budget)
        return plan

    @property
    def _forward_model(self) -> torch.nn.Module:
        return self.engine

    def _zero_grad(self) -> None:
        """The engine zeroes gradients after each step."""

    def accumulate_gradients(self, plan: StepPlan) -> LossStats:
        mine = plan.micro_batches[self.rank :: self.world_size]
        passes = math.ceil(len(plan.micro_batches) / self.world_size)
        stats = LossStats()
        self.engine.train()
        try:
            for index in range(passes):
                real = index < len(mine)
                batch = mine[index] if real else plan.micro_batches[0]
                output = policy_loss(self._loss_inputs(batch.to(self.device)), self.config.loss, plan.totals)
                self.engine.set_gradient_accumulation_boundary(index == passes - 1)
                # A non-finite loss poisons the gradient, so that DeepSpeed skips the step on every rank.
                scale = (self.world_size if real else 0.0) if torch.isfinite(output.loss) else math.nan
                self.engine.backward(output.loss * scale)
                if real:
                    stats += output.stats
        finally:
            self.engine.eval()
        gathered: list[LossStats | None] = [None] * self.world_size
        dist.all_gather_object(gathered, stats, group=self._calls)
        return sum((s for s in gathered if s is not None), LossStats())

    def _optimizer_step(self, loss: float) -> tuple[float, bool]:
        """DeepSpeed clips and steps. Its ZeRO optimizers skip a step whose global gradient norm is
        not finite (fp32 always, bf16 with check_grad_overflow) and zero the gradients on every rank;
        a non-finite loss reaches that check through its poisoned gradient."""
        self.engine.step()
        stepped = self.engine.was_step_applied()
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else math.nan
        if not stepped:
            log.warning(
                "non-finite loss or gradient norm; DeepSpeed skipped the step", loss=loss, grad_norm=grad_norm
            )
        elif not math.isfinite(grad_norm):
            log.error("non-finite gradient norm, yet DeepSpeed took the step", grad_norm=grad_norm)
        return grad_norm, stepped

    def _gather_each(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter in full, one at a time (a collective under ZeRO-3: all ranks iterate)."""
        import deepspeed

        for name, param in self.model.named_parameters():
            if self.zero.stage < 3:
                yield name, param.detach()
                continue
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.detach()

    def _write_checkpoint(self, staging: Path) -> None:
        dist.barrier(group=self._calls)  # rank 0 has created the directory
        state = {name: tensor.to("cpu", copy=True) for name, tensor in self._gather_each() if self.rank == 0}
        if self.rank == 0:
            staging.mkdir(parents=True, exist_ok=True)
            save_weights(self.model, staging, state)
        self.engine.save_checkpoint(str(staging / DEEPSPEED_DIR), tag=_TAG, save_latest=False)
        dist.barrier(group=self._calls)  # every rank's partition is on disk before rank 0 commits

    def _read_checkpoint(self, directory: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(directory / DEEPSPEED_DIR), tag=_TAG)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {directory / DEEPSPEED_DIR}")


class _GatheredParameters:
    """ZeRO-3 weights for the publisher: shapes from the partition metadata, data gathered on read."""

    def __init__(self, learner: DeepSpeedLearner) -> None:
        self.learner = learner

    def specs(self) -> list[tuple[str, torch.Tensor]]:
        return [
            # ZeRO-3 adds ds_shape, the full shape, to each parameter it partitions.
            (name, torch.empty(param.ds_shape, dtype=param.dtype, device="meta"))  # pyright: ignore[reportAttributeAccessIssue]
            for name, param in self.learner.model.named_parameters()
        ]

    def read(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.learner._send("_gather_each")
        return self.learner._gather_each()
