"""Prometheus metrics of a service: one registry per server, served over HTTP at `/metrics`.

    role metrics (counters, histograms observed where things happen)  ─┐
    LoopCollector(snapshot): gauges read from the core at scrape time ─┼─► CollectorRegistry
    gRPC server metrics (grpc_metrics.py)                             ─┘        │
                                               MetricsEndpoint ── thread ── GET /metrics

The exposition runs in a thread of its own, while a service's state lives in its event loop; a
`LoopCollector` therefore takes its snapshot inside the loop, so a scrape never reads a half-made
update. Names follow `pipelinerl_<role>_<what>_<unit>` (docs/observability.md lists them all).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pipelinerl.common.log import get_logger

log = get_logger(__name__)

SNAPSHOT_TIMEOUT_S = 5.0


class LoopCollector(Collector):
    """Metric families made by `snapshot()` in `loop`, the event loop that owns the state it reads."""

    def __init__(self, snapshot: Callable[[], Iterable[Metric]], loop: asyncio.AbstractEventLoop) -> None:
        self._snapshot = snapshot
        self._loop = loop

    def collect(self) -> Iterable[Metric]:
        try:
            in_loop = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            in_loop = False
        if in_loop:
            return list(self._snapshot())

        async def snapshot() -> list[Metric]:
            return list(self._snapshot())

        if self._loop.is_closed():
            return []
        return asyncio.run_coroutine_threadsafe(snapshot(), self._loop).result(SNAPSHOT_TIMEOUT_S)


def register_snapshot(registry: CollectorRegistry, snapshot: Callable[[], Iterable[Metric]]) -> None:
    """Register `snapshot` to run in the current event loop at every scrape."""
    registry.register(LoopCollector(snapshot, asyncio.get_running_loop()))


def gauges(prefix: str, docs: Mapping[str, str], values: Mapping[str, float]) -> Iterator[Metric]:
    """A gauge family `<prefix>_<name>` per value, documented by `docs[name]`."""
    for name, value in values.items():
        yield GaugeMetricFamily(f"{prefix}_{name}", docs[name], value=value)


def counters(prefix: str, docs: Mapping[str, str], values: Mapping[str, float]) -> Iterator[Metric]:
    """A counter family `<prefix>_<name>_total` per value (a count kept by the core itself)."""
    for name, value in values.items():
        yield CounterMetricFamily(f"{prefix}_{name}", docs[name], value=value)


class _Server(ThreadingMixIn, WSGIServer):
    """prometheus_client's `start_http_server`, binding with SO_REUSEPORT as gRPC does, so that it
    can bind a port the launcher holds for it (launcher/ports.py)."""

    daemon_threads = True
    allow_reuse_port = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class MetricsEndpoint:
    """`GET /metrics` of `registry` on host:port, served by a daemon thread until `stop`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        address = host.strip("[]")
        family = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM)[0][0]
        server_class = type("MetricsServer", (_Server,), {"address_family": family})
        self._server: WSGIServer = make_server(
            address, port, make_wsgi_app(registry), server_class, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)
        self._thread.start()
        self.port: int = self._server.server_port
        log.info("serving metrics", url=f"http://{host}:{self.port}/metrics")

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
