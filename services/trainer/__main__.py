"""`python -m pipelinerl.trainer [--config FILE] [--flags]` (or `pipelinerl serve trainer`)."""

from __future__ import annotations

import sys

from pipelinerl.common.log import bind_context
from pipelinerl.common.server import GrpcServer, run_service
from pipelinerl.trainer.config import TrainerSettings


async def build(settings: TrainerSettings) -> GrpcServer:
    """Load the model, resume from the latest checkpoint, publish the current version, serve."""
    import torch

    from pipelinerl.common.model import load_model
    from pipelinerl.common.publisher import PublisherConfig, WeightPublisher
    from pipelinerl.trainer.learner import TorchLearner
    from pipelinerl.trainer.server import registration
    from pipelinerl.trainer.trainer import Trainer, TrainerLoopConfig

    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    bind_context(run=settings.run_id)
    loaded = load_model(
        settings.model, seed=settings.seed, dtype=getattr(torch, settings.dtype), device=settings.device
    )
    loaded.model.train()
    learner = TorchLearner(loaded.model, settings.learner, tokenizer=loaded.tokenizer)
    publisher = WeightPublisher(
        PublisherConfig(
            run_id=settings.run_id,
            bucket_bytes=settings.bucket_bytes,
            broadcast_backend=None if settings.broadcast_backend == "none" else settings.broadcast_backend,
            store_host=settings.host,
            store_port=settings.store_port,
            advertise_host=settings.advertise_host,
            broadcast_timeout_s=settings.broadcast_timeout_s,
        )
    )
    await publisher.start()
    loop_config = TrainerLoopConfig(
        samples_per_step=settings.samples_per_step,
        max_lag=settings.max_lag,
        lag_policy=settings.lag_policy,
        max_buffered_samples=settings.max_buffered_samples,
        checkpoint_dir=settings.checkpoint_dir,
        checkpoint_every=settings.checkpoint_every,
        metrics_file=settings.metrics_file,
    )
    trainer = Trainer(learner, publisher, loop_config)
    await trainer.start()
    return GrpcServer(settings, [registration(trainer)], on_close=[trainer.close, publisher.close])


def main(argv: list[str]) -> None:
    run_service("trainer", TrainerSettings, build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
