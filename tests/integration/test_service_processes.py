"""The launcher's service processes (services/launcher/processes.py): a pinned service starts whole
while gRPC calls run in the launcher, as they do when its supervisor restarts one; a restart that
dies before it serves still hands the service's ports to the next; and nothing else can take a
service's ports while it is down."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pipelinerl.common.health import wait_until_serving
from pipelinerl.launcher.ports import hold_port
from pipelinerl.launcher.processes import start_service

PROBE = """\
import os, sys
from pathlib import Path
config = Path(sys.argv[sys.argv.index("--config") + 1])
config.with_suffix(".cores").write_text(" ".join(map(str, sorted(os.sched_getaffinity(0)))))
"""
STARTS = 40
"""Before the fix a start crashed about one time in five here: 40 without a crash had odds of 1e-4."""


async def test_pinned_services_start_whole_while_grpc_calls_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "cores_probe.py").write_text(PROBE)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cores = {min(os.sched_getaffinity(0))}
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stop = asyncio.Event()

    async def check() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

    checks = [asyncio.ensure_future(check()) for _ in range(4)]
    try:
        for i in range(STARTS):
            service = start_service(f"probe-{i}", "cores_probe", {}, tmp_path, cores)
            assert await asyncio.to_thread(service.process.wait, 30) == 0, service.log_tail()
            assert (tmp_path / f"probe-{i}.cores").read_text() == " ".join(map(str, sorted(cores)))
    finally:
        stop.set()
        await asyncio.gather(*checks, return_exceptions=True)
        await server.stop(0)


def test_a_restart_that_dies_before_serving_hands_its_ports_to_the_next(tmp_path: Path) -> None:
    first = start_service("svc", "no_such_module_here", {}, tmp_path)
    first.process.wait(30)
    first.port, first.metrics_port = 45001, 45002  # as `wait_healthy` read them when it served
    second = first.restart()
    assert second.process.wait(30) != 0  # it never serves, so it never reads a ready file
    third = second.restart()
    third.process.wait(30)
    assert (third.port, third.metrics_port) == (45001, 45002)
    config = yaml.safe_load((tmp_path / "svc.yaml").read_text())
    assert (config["port"], config["metrics_port"]) == (45001, 45002)


async def test_a_service_s_ports_stay_its_own_while_it_is_down(tmp_path: Path) -> None:
    """Nothing else on the machine can take a dead service's ports before its restart binds them:
    not a bind of its own, not the kernel's choice for port 0, with or without SO_REUSEPORT
    (services/launcher/ports.py)."""
    service = start_service("reward", "pipelinerl.reward", {"workers": 1, "metrics_port": 0}, tmp_path)
    try:
        await service.wait_healthy(60)
        ports = (service.port, service.metrics_port)
        assert None not in ports and len(set(ports)) == 2, ports
        service.process.kill()
        service.process.wait()
        for port in ports:
            with socket.socket() as taker, pytest.raises(OSError, match="in use"):
                taker.bind(("127.0.0.1", port))
        chosen = set()
        for n in range(2000):  # another run's launcher holds ports with SO_REUSEPORT
            with hold_port("127.0.0.1") if n % 2 else socket.socket() as other:
                if not n % 2:
                    other.bind(("127.0.0.1", 0))
                chosen.add(other.getsockname()[1])
        assert not chosen & set(ports)
        service = service.restart()
        await service.wait_healthy(60)
        assert (service.port, service.metrics_port) == ports
        assert await wait_until_serving(service.address, timeout_s=10)
    finally:
        assert service.stop() is not None
    for port in ports:  # free once the service has stopped for good
        with socket.socket() as after:
            after.bind(("127.0.0.1", port))
