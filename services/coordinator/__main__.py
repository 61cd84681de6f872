"""`python -m pipelinerl.coordinator [--config FILE] [--flags]` (or `pipelinerl serve coordinator`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

from pipelinerl.common.channel import ChannelConfig
from pipelinerl.common.server import GrpcServer, run_service
from pipelinerl.coordinator.config import CoordinatorSettings


async def build(settings: CoordinatorSettings) -> GrpcServer:
    """The coordinator with its journal and clients; runs start with StartRun. Async because gRPC
    channels belong to the event loop that creates them."""
    from prometheus_client import CollectorRegistry

    from pipelinerl.coordinator import metrics
    from pipelinerl.coordinator.coordinator import Coordinator
    from pipelinerl.coordinator.journal import Journal
    from pipelinerl.coordinator.membership import Membership
    from pipelinerl.coordinator.pool import InferencePool
    from pipelinerl.coordinator.replicas import PROBE_TIMEOUT_S, ReplicaPool
    from pipelinerl.coordinator.reward_pool import RewardPool
    from pipelinerl.coordinator.server import registration
    from pipelinerl.coordinator.submitter import TrainerSubmitter
    from pipelinerl.coordinator.types import InferenceRole
    from pipelinerl.environment.client import EnvironmentClient
    from pipelinerl.trainer.client import TrainerClient

    def channel(address: str) -> ChannelConfig:
        return ChannelConfig(
            address,
            auth_token=settings.services_auth_token,
            tls_ca_file=settings.services_tls_ca_file,
            keepalive=settings.keepalive,
        )

    journal = Journal(settings.journal_path)
    reward = RewardPool(channel)
    reward_membership = Membership(
        reward,
        static=settings.reward_address,
        dns=settings.reward_dns,
        refresh_s=settings.membership_refresh_s,
        role="reward",
    )
    trainer = TrainerClient(channel(settings.trainer_address))
    pool = InferencePool(channel, trainer=trainer)
    membership = Membership(
        pool,
        static=settings.inference_addresses,
        dns=settings.inference_dns,
        refresh_s=settings.membership_refresh_s,
        lease_s=settings.inference_lease_s,
    )
    evaluation_pool = InferencePool(channel)
    evaluation_membership = Membership(
        evaluation_pool,
        static=settings.evaluation_addresses,
        dns=settings.evaluation_dns,
        refresh_s=settings.membership_refresh_s,
        lease_s=settings.inference_lease_s,
        role="evaluation",
    )
    environments = ReplicaPool("environment replica", EnvironmentClient, channel)
    environment_membership = Membership(
        environments,
        static=settings.environment_addresses,
        dns=settings.environment_dns,
        refresh_s=settings.membership_refresh_s,
        role="environment",
    )
    submitter = TrainerSubmitter(trainer, journal, on_state=pool.follow)
    gateway = None
    if settings.agent_gateway_port is not None:
        try:
            from pipelinerl.coordinator.gateway import AgentGateway
        except ImportError as exc:
            raise SystemExit(
                f"the agent endpoint (agent_gateway_port) needs FastAPI and uvicorn ({exc.name} is missing): "
                "install pipelinerl[agent] (in the coordinator image: COORDINATOR_EXTRAS=coordinator,agent)"
            ) from exc

        model = Path(settings.tokenizer).name if settings.tokenizer else "policy"
        host, port, url = settings.agent_gateway_host, settings.agent_gateway_port, settings.agent_gateway_url
        gateway = AgentGateway(host, port, url, model)
        await gateway.start()
    coordinator = Coordinator(
        journal, pool, reward, submitter, settings.tokenizer, environments, evaluation_pool, gateway
    )

    await pool.start()
    await membership.start()
    await evaluation_pool.start()
    await evaluation_membership.start()
    await reward.start()
    await reward_membership.start()
    await environments.start()
    await environment_membership.start()
    with contextlib.suppress(TimeoutError):  # the first health checks: serve knowing whether one is up
        await asyncio.wait_for(reward.wait_reachable(True), PROBE_TIMEOUT_S)
    submitter.start()
    registry = CollectorRegistry()
    metrics.watch(registry, coordinator.runs, journal.counts, pool, reward, environments)
    if gateway is not None:
        gateway.watch(registry)

    follower: list[asyncio.Task[None]] = []

    async def follow_reward() -> None:
        """Health `""` says NOT_SERVING while no reward replica is up: runs cannot score."""
        ready = True  # as the server starts
        while True:
            await reward.wait_reachable(not ready)
            ready = not ready
            await server.set_ready(ready, "no reward replica is reachable")

    async def start_following() -> None:
        follower.append(asyncio.create_task(follow_reward()))

    async def close() -> None:
        for task in follower:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await coordinator.close()
        await submitter.close()
        await membership.close()
        await evaluation_membership.close()
        await reward_membership.close()
        await environment_membership.close()
        await pool.close()
        await evaluation_pool.close()
        await reward.close()
        await environments.close()
        await trainer.close()
        if gateway is not None:
            await gateway.close()
        journal.close()

    server = GrpcServer(
        settings,
        [
            registration(
                coordinator,
                {InferenceRole.TRAINING: membership, InferenceRole.EVALUATION: evaluation_membership},
            )
        ],
        on_start=[start_following],
        on_drain=[coordinator.close],
        on_close=[close],
        registry=registry,
    )
    return server


def main(argv: list[str]) -> None:
    run_service("coordinator", CoordinatorSettings, build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
