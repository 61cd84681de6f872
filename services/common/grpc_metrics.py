"""gRPC server metrics of every service, from one interceptor: calls started and handled per
method and status code, and how long each took (a stream: until its last response).

Labels follow go-grpc-prometheus (`grpc_service`, `grpc_method`, `grpc_type`, `grpc_code`), so
existing gRPC dashboards and alerts apply as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from pipelinerl.common.handlers import Continuation, wrap_calls

LABELS = ("grpc_service", "grpc_method", "grpc_type")
BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)


def _type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    return "server_stream" if handler.response_streaming else "unary"


def _code(context: grpc.aio.ServicerContext, error: BaseException | None) -> str:
    """The call's status code: as set (an abort sets it), else from how the behaviour ended."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    if error is None:
        return "OK"
    return "CANCELLED" if isinstance(error, asyncio.CancelledError | GeneratorExit) else "UNKNOWN"


class GrpcMetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts and times every call; outside all interceptors but `UnaryRequestInterceptor`, so it
    sees every code returned except that of a unary call that never got its request message."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._started = Counter("pipelinerl_grpc_server_started", "Calls started.", LABELS, registry=registry)
        self._handled = Counter(
            "pipelinerl_grpc_server_handled",
            "Calls finished, by status code.",
            (*LABELS, "grpc_code"),
            registry=registry,
        )
        self._seconds = Histogram(
            "pipelinerl_grpc_server_handling_seconds",
            "Time from a call's start to its status (a stream's whole life).",
            LABELS,
            buckets=BUCKETS_S,
            registry=registry,
        )

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, _, method = handler_call_details.method.strip("/").rpartition("/")
        labels = (service, method, _type(handler))

        @contextmanager
        def observed(context: grpc.aio.ServicerContext) -> Iterator[None]:
            self._started.labels(*labels).inc()
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                yield
            except BaseException as exc:
                error = exc
                raise
            finally:
                self._handled.labels(*labels, _code(context, error)).inc()
                self._seconds.labels(*labels).observe(time.perf_counter() - started)

        return wrap_calls(handler, observed)
