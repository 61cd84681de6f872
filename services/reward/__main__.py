"""`python -m pipelinerl.reward [--config FILE] [--flags]` (or `pipelinerl serve reward`)."""

from __future__ import annotations

import asyncio
import sys

from pipelinerl.common.server import GrpcServer, run_service
from pipelinerl.reward.config import RewardSettings


async def build(settings: RewardSettings) -> GrpcServer:
    """The reward server with its scorer; the scorer closes after the server has drained."""
    from prometheus_client import CollectorRegistry

    from pipelinerl.reward.metrics import RewardMetrics
    from pipelinerl.reward.scoring import Scorer
    from pipelinerl.reward.server import registration

    registry = CollectorRegistry()
    metrics = RewardMetrics(registry)
    scorer = Scorer(settings.reward, workers=settings.workers, timeout_s=settings.timeout_s, metrics=metrics)
    metrics.watch(lambda: scorer.stats)

    async def close() -> None:
        await asyncio.to_thread(scorer.close)

    return GrpcServer(settings, [registration(scorer)], on_close=[close], registry=registry)


def main(argv: list[str]) -> None:
    run_service("reward", RewardSettings, build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
