"""An inference server's membership of a coordinator's pool (the training servers', or by its role
the evaluation servers'): register once serving, renew about every third of the lease, say
`leaving` on drain (so the coordinator stops routing to it at once).

    start() ──► RegisterInferenceServer(address) ──► lease L ──► sleep L/3 ──► again ...
                  └─ coordinator away: retry every RETRY_S (its lease lapses meanwhile; the next
                     registration is a join again)
    leave() ──► stop renewing ──► RegisterInferenceServer(address, leaving=True), best effort
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

from pipelinerl.common.errors import PipelineError
from pipelinerl.common.log import get_logger
from pipelinerl.common.server import join_host_port
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.types import InferenceRole

log = get_logger(__name__)

RETRY_S = 1.0


def advertised_address(configured: str | None, host: str, port: int) -> str:
    """`configured`, or the bound `host:port` with this machine's name for a wildcard host."""
    if configured:
        return configured
    return join_host_port(socket.gethostname() if host in ("0.0.0.0", "::", "") else host, port)


class CoordinatorLease:
    def __init__(self, coordinator: CoordinatorClient, role: InferenceRole = InferenceRole.TRAINING) -> None:
        self._coordinator = coordinator
        self._role = role
        self._address = ""
        self._task: asyncio.Task[None] | None = None

    async def start(self, address: str) -> None:
        self._address = address
        self._task = asyncio.create_task(self._renew_forever())

    async def leave(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        with contextlib.suppress(PipelineError):
            await self._coordinator.register_inference_server(
                self._address, leaving=True, timeout_s=2.0, role=self._role
            )
            log.info("left the coordinator's pool", address=self._address)

    async def _renew_forever(self) -> None:
        joined = False
        while True:
            try:
                lease_s = await self._coordinator.register_inference_server(
                    self._address, timeout_s=5.0, role=self._role
                )
            except PipelineError as exc:
                log.warning(
                    "coordinator registration failed; retrying", address=self._address, error=exc.message
                )
                joined = False
                await asyncio.sleep(RETRY_S)
                continue
            if not joined:
                log.info(
                    "joined the coordinator's pool",
                    address=self._address,
                    role=self._role.value,
                    lease_s=lease_s,
                )
                joined = True
            await asyncio.sleep(max(lease_s / 3, 0.1))
