"""`python -m pipelinerl.environment --env pkg.module:Class [--config FILE] [--flags]` (or
`pipelinerl serve environment`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from typing import TYPE_CHECKING

from pipelinerl.common.log import get_logger
from pipelinerl.common.server import GrpcServer, run_service
from pipelinerl.environment.config import EnvironmentSettings
from pipelinerl.environment.loader import EnvironmentLoadError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from pipelinerl.environment.metrics import EnvironmentMetrics

log = get_logger(__name__)


async def build(settings: EnvironmentSettings) -> GrpcServer:
    """The environment server with its episode table; the class is loaded and checked first, so a
    wrong `env` fails here, before anything binds. Draining refuses new episodes (UNAVAILABLE) while
    held ones are answered; the instances close after the server has stopped."""
    from prometheus_client import CollectorRegistry

    from pipelinerl.environment.episodes import EpisodeTable
    from pipelinerl.environment.loader import load_environment
    from pipelinerl.environment.metrics import EnvironmentMetrics
    from pipelinerl.environment.server import registration

    registry = CollectorRegistry()
    metrics = EnvironmentMetrics(registry)
    if settings.agent is not None:
        return _agent_host(settings, settings.agent, registry, metrics)
    assert settings.env is not None  # one of the two, by the settings' check
    cls = load_environment(settings.env, settings.env_args)
    episodes = EpisodeTable(cls, settings.env_args, settings.limits(), observe_step=metrics.step_answered)
    metrics.watch(lambda: episodes.stats)
    reaper: asyncio.Task[None] | None = None

    async def start_reaping() -> None:
        nonlocal reaper
        reaper = asyncio.create_task(episodes.reap_forever(), name="reaper")

    async def stop_starting() -> None:
        episodes.stop_starting()

    async def close() -> None:
        if reaper is not None:
            reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reaper
        await episodes.close()

    return GrpcServer(
        settings,
        [registration(episodes)],
        on_start=[start_reaping],
        on_drain=[stop_starting],
        on_close=[close],
        registry=registry,
    )


def _agent_host(
    settings: EnvironmentSettings, spec: str, registry: CollectorRegistry, metrics: EnvironmentMetrics
) -> GrpcServer:
    """An agent host: RunEpisode calls the agent function; draining refuses new episodes while
    running ones go on for `drain_seconds`."""
    from pipelinerl.environment.agent_host import AgentHost
    from pipelinerl.environment.loader import agent_name, load_agent
    from pipelinerl.environment.server import registration

    host = AgentHost(agent_name(spec), load_agent(spec), settings.env_args, settings.agent_limits())
    metrics.watch(lambda: host.stats)

    async def stop_starting() -> None:
        host.stop_starting()

    return GrpcServer(settings, [registration(host)], on_drain=[stop_starting], registry=registry)


def main(argv: list[str]) -> None:
    try:
        run_service("environment", EnvironmentSettings, build, argv)
    except EnvironmentLoadError as exc:
        log.error("cannot load the environment class or agent", error=str(exc))
        raise SystemExit(2) from None


if __name__ == "__main__":
    main(sys.argv[1:])
