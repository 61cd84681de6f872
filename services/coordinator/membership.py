"""Which servers are in a pool (the inference servers, the reward replicas), from three sources,
any combination:

    static list (`inference_addresses`) ─┐
    DNS names (`inference_dns`), each    ├─► every `refresh_s`: members = the union ─► pool.add / remove
      re-resolved: one member per record │
    registrations (RegisterInferenceServer), each held for `lease_s` unless renewed ─┘

A Kubernetes headless Service answers one record per ready pod, so `kubectl scale` changes the
pool. A name that fails to resolve keeps its last answer (a DNS hiccup removes nobody); a
registration that says `leaving` is dropped at once. Reward replicas come from the first two
sources only (`reward_address`, `reward_dns`).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterable
from typing import Protocol

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.log import get_logger

log = get_logger(__name__)


class Pool(Protocol):
    """What membership changes: `InferencePool`, `RewardPool`."""

    @property
    def members(self) -> set[str]: ...

    def add(self, address: str) -> None: ...

    def remove(self, address: str) -> None: ...


def split_address(address: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port); InvalidArgument otherwise."""
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument.field("address", f"expected host:port, got {address!r}")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(name: str) -> set[str]:
    """Every address `name` (`host:port`) resolves to, as `ip:port`; OSError if it does not."""
    host, port = split_address(name)
    records = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return {join_address(str(sockaddr[0]), port) for _, _, _, _, sockaddr in records}


class Membership:
    """Keeps `pool`'s members equal to the static addresses, the DNS answers and the live leases."""

    def __init__(
        self,
        pool: Pool,
        static: Iterable[str] = (),
        dns: Iterable[str] = (),
        refresh_s: float = 5.0,
        lease_s: float = 15.0,
        role: str = "inference",
    ) -> None:
        """`role` names the pool's servers in log lines."""
        self._pool = pool
        self._log = log.bind(role=role)
        self._static = set(static)
        self._dns: dict[str, set[str]] = {name: set() for name in dns}
        self._leases: dict[str, float] = {}
        """Registered address -> when its lease lapses (monotonic clock)."""
        self.refresh_s = refresh_s
        self.lease_s = lease_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def register(self, address: str, leaving: bool) -> float:
        """Add or renew `address` (or drop it, when `leaving`); the lease granted, in seconds."""
        split_address(address)
        if leaving:
            self._leases.pop(address, None)
            self._apply()
            return 0.0
        if address not in self._leases:
            self._log.info("server registered", server=address, lease_s=self.lease_s)
        self._leases[address] = time.monotonic() + self.lease_s
        self._apply()
        return self.lease_s

    async def refresh(self) -> None:
        """Resolve every DNS name again, drop lapsed leases, and bring the pool in line."""
        for name in self._dns:
            try:
                self._dns[name] = await resolve(name)
            except OSError as exc:
                self._log.warning(
                    "DNS name did not resolve; keeping its last answer", name=name, error=str(exc)
                )
        now = time.monotonic()
        for address in [a for a, until in self._leases.items() if until <= now]:
            self._log.warning("server lease lapsed", server=address)
            del self._leases[address]
        self._apply()

    def _apply(self) -> None:
        wanted = self._static | set(self._leases) | set().union(*self._dns.values())
        for address in wanted - self._pool.members:
            self._pool.add(address)
        for address in self._pool.members - wanted:
            self._pool.remove(address)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()
