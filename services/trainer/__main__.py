"""`python -m pipelinerl.trainer [--config FILE] [--flags]` (or `pipelinerl serve trainer`).

With `--backend deepspeed` under torchrun, rank 0 serves and the other ranks follow its learner.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from pipelinerl.common.log import bind_context, configure_logging
from pipelinerl.common.server import GrpcServer, run_service
from pipelinerl.common.settings import split_config_flag
from pipelinerl.trainer.config import TrainerSettings

if TYPE_CHECKING:
    from pipelinerl.trainer.learner import Learner

RUN_CONFIG = {"model", "seed", "dtype", "samples_per_step", "max_lag", "lag_policy", "learner", "zero"}
"""The settings a tracked run records as its config (none that is a secret or a local path)."""


def build_learner(settings: TrainerSettings) -> Learner:
    """The model (a preset or a local HF directory) and the learner of `settings.backend`."""
    import torch

    from pipelinerl.common.model import load_model
    from pipelinerl.trainer.learner import TorchLearner

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    device = settings.device
    if settings.backend == "deepspeed":
        _init_world(device)
        if device.startswith("cuda"):
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
    loaded = load_model(
        settings.model, seed=settings.seed, dtype=getattr(torch, settings.dtype), device=device
    )
    loaded.model.train()
    if settings.backend == "deepspeed":
        from pipelinerl.trainer.deepspeed_learner import DeepSpeedLearner

        return DeepSpeedLearner(loaded.model, settings.learner, settings.zero, tokenizer=loaded.tokenizer)
    return TorchLearner(loaded.model, settings.learner, tokenizer=loaded.tokenizer)


def _init_world(device: str) -> None:
    """Join the torchrun world (or make a world of one when started without torchrun)."""
    import deepspeed

    from pipelinerl.common.channel import free_port

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(minutes=30))


async def build(settings: TrainerSettings) -> GrpcServer:
    """Load the model, resume from the latest checkpoint, publish the current version, serve."""
    from prometheus_client import CollectorRegistry

    from pipelinerl.trainer.metrics import TrainerMetrics
    from pipelinerl.trainer.server import registration
    from pipelinerl.trainer.tracking import StepLogs
    from pipelinerl.trainer.trainer import Trainer
    from pipelinerl.weights.publisher import WeightPublisher

    bind_context(run=settings.run_id)
    learner = build_learner(settings)
    publisher = WeightPublisher(settings, settings.run_id, store_host=settings.host)
    await publisher.start()
    registry = CollectorRegistry()
    metrics = TrainerMetrics(registry)
    run_config = settings.model_dump(mode="json", include=RUN_CONFIG)
    step_logs = StepLogs.open(settings.tracking, settings.run_id, run_config)
    # Should training stop for good, health says so, so that probes restart the trainer.
    trainer = Trainer(
        learner,
        publisher,
        settings,
        on_halt=lambda reason: server.set_not_serving(reason),
        metrics=metrics,
        step_logs=step_logs,
    )
    metrics.watch(trainer.status, settings.max_buffered_samples)

    async def close_learner() -> None:
        learner.close()

    server = GrpcServer(
        settings,
        [registration(trainer)],
        on_close=[trainer.close, publisher.close, close_learner],
        registry=registry,
    )
    await trainer.start()
    return server


def follow(argv: list[str]) -> None:
    """A rank other than 0: build the same learner and run rank 0's calls until it closes. SIGTERM
    (torchrun forwards it to every rank) is left to rank 0, whose last checkpoint needs this rank."""
    from pipelinerl.trainer.deepspeed_learner import DeepSpeedLearner

    config_file, cli_args = split_config_flag(argv)
    settings = TrainerSettings.load(config_file, cli_args)
    configure_logging("trainer", settings.log_format, settings.log_level)
    bind_context(run=settings.run_id, rank=int(os.environ["RANK"]))
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    learner = build_learner(settings)
    if not isinstance(learner, DeepSpeedLearner):
        raise ValueError("ranks other than 0 need --backend deepspeed")
    learner.follow()


def main(argv: list[str]) -> None:
    if int(os.environ.get("RANK", "0")) > 0:
        follow(argv)
    else:
        run_service("trainer", TrainerSettings, build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
