"""`python -m pipelinerl.reward [--config FILE] [--flags]` (or `pipelinerl serve reward`)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from pipelinerl.common.log import configure_logging
from pipelinerl.common.server import GrpcServer
from pipelinerl.reward.config import RewardSettings


def build(settings: RewardSettings) -> GrpcServer:
    """The reward server with its scorer; the scorer closes after the server has drained."""
    from pipelinerl.reward.scoring import Scorer
    from pipelinerl.reward.server import registration

    scorer = Scorer(settings.reward, workers=settings.workers, timeout_s=settings.timeout_s)

    async def close() -> None:
        await asyncio.to_thread(scorer.close)

    return GrpcServer(settings, [registration(scorer)], on_close=[close])


def serve(config_file: Path | None, cli_args: list[str]) -> None:
    settings = RewardSettings.load(config_file, cli_args)
    configure_logging("reward", settings.log_format, settings.log_level)
    asyncio.run(build(settings).serve_until_signal())


if __name__ == "__main__":
    from pipelinerl.cli import split_config_flag

    serve(*split_config_flag(sys.argv[1:]))
