"""The gRPC server every service runs on: asyncio server, health, reflection, auth, TLS, limits,
domain-error mapping and a graceful SIGTERM.

    settings ──► GrpcServer(settings, [Registration(...)]) ──► start() ── binds host:port
                     │ interceptors: one request per unary call → call metrics → trace ids
                     │               → bearer token (health exempt) → domain error → gRPC status
                     │ grpc.health.v1 (SERVING per service) + reflection
                     │ /metrics on metrics_port, if set (the server's `registry`)
    SIGTERM ──► drain(): health NOT_SERVING → on_drain hooks → server.stop(grace=drain_seconds)

A servicer raises `pipelinerl.common.errors.*`; the interceptor aborts the call with the mapped code
and google.rpc details, so servicers hold no status-code logic of their own.
"""

from __future__ import annotations

import asyncio
import hmac
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from pipelinerl.common.errors import InvalidArgument, PipelineError
from pipelinerl.common.grpc_metrics import GrpcMetricsInterceptor
from pipelinerl.common.handlers import Continuation, stream_responses, wrap_behavior
from pipelinerl.common.log import configure_logging, get_logger
from pipelinerl.common.metrics import MetricsEndpoint
from pipelinerl.common.settings import ServiceSettings, split_config_flag
from pipelinerl.common.status import rpc_status
from pipelinerl.common.trace import TraceContextInterceptor
from pipelinerl.common.unary_request import UnaryRequestInterceptor

log = get_logger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"


@dataclass(frozen=True)
class Registration:
    """One gRPC service to serve: its full name (`pipelinerl.reward.v1.RewardService`) and how to
    add its servicer to a server (the generated `add_<Name>Servicer_to_server` bound to a servicer)."""

    name: str
    add_to_server: Callable[[grpc.aio.Server], None]


def join_host_port(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed (`[::1]:50051`)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Message-size options shared by servers and client channels."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


@dataclass(frozen=True)
class _Malformed:
    """A unary request whose bytes did not parse; the call wrapper raises `error`."""

    error: InvalidArgument


def _checked_deserializer(handler: grpc.RpcMethodHandler) -> Callable[[bytes], Any] | None:
    """The handler's deserializer, with a parse failure turned into InvalidArgument: gRPC itself
    answers a unary one with UNKNOWN and leaves a request stream hanging."""
    deserializer = handler.request_deserializer
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError as exc:
            error = InvalidArgument(f"the request is not a valid message: {exc}")
            if handler.request_streaming:
                raise error from exc  # surfaces where the servicer reads the stream
            return _Malformed(error)  # gRPC parses a unary request before the servicer runs

    return deserialize


def _raise_if_malformed(request: Any) -> None:
    if isinstance(request, _Malformed):
        raise request.error


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def _enable_reflection(names: Sequence[str], server: grpc.aio.Server) -> None:
    """Server reflection under both names clients use: `grpc.reflection.v1alpha` (grpcio-reflection
    serves it) and `grpc.reflection.v1` (what current grpcurl and Postman ask first), one servicer
    for both: the two packages' messages are the same on the wire."""
    servicer = reflection.aio.ReflectionServicer([*names, reflection.SERVICE_NAME, REFLECTION_V1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),)
    )


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Turns a `PipelineError` raised by a servicer, or a request that is not a valid message, into
    its status code with google.rpc details."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    _raise_if_malformed(request)
                    return await behavior(request, context)
                except PipelineError as exc:
                    log.info("call failed", method=method, code=exc.code, error=exc.message)
                    await context.abort_with_status(rpc_status(exc))  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's grpc stubs lack aio ServicerContext.abort_with_status

            return unary

        def wrap_stream(behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                try:
                    _raise_if_malformed(request)
                    async for response in stream_responses(behavior, request, context):
                        yield response
                except PipelineError as exc:
                    log.info("stream failed", method=method, code=exc.code, error=exc.message)
                    await context.abort_with_status(rpc_status(exc))  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's grpc stubs lack aio ServicerContext.abort_with_status

            return stream

        return wrap_behavior(handler, wrap_unary, wrap_stream, _checked_deserializer(handler))


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>`; health checks stay open for probes."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        sent = str(metadata.get("authorization", "")).encode()
        if hmac.compare_digest(sent, self._expected):
            return handler

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
            yield  # pragma: no cover - makes this an async generator like the real handler

        return wrap_behavior(handler, lambda _: deny, lambda _: deny_stream)


@dataclass
class GrpcServer:
    """A started or startable server for one or more services."""

    settings: ServiceSettings
    services: Sequence[Registration]
    on_start: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Called once the server is bound and SERVING, e.g. to announce its address."""
    on_drain: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Called on shutdown before the grace period starts, e.g. to end long-lived streams politely."""
    on_close: list[Callable[[], Awaitable[None]]] = field(default_factory=list)
    """Called after the server stopped, e.g. to release engines and process pools."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    """Where the service's own metrics are registered; served with the gRPC metrics on `metrics_port`."""

    port: int = 0
    _server: grpc.aio.Server | None = None
    _metrics: MetricsEndpoint | None = None
    _health: HealthServicer = field(default_factory=HealthServicer)

    async def start(self) -> int:
        """Bind and start serving; returns the bound port."""
        interceptors: list[grpc.aio.ServerInterceptor] = [
            UnaryRequestInterceptor(),
            GrpcMetricsInterceptor(self.registry),
            TraceContextInterceptor(),
        ]
        if self.settings.auth_token:
            interceptors.append(BearerTokenInterceptor(self.settings.auth_token))
        interceptors.append(ErrorMappingInterceptor())
        options = [
            *channel_options(self.settings.max_message_bytes),
            *self.settings.keepalive.server_options(),
        ]
        server = grpc.aio.server(interceptors=interceptors, options=options)
        for service in self.services:
            service.add_to_server(server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = [s.name for s in self.services]
        health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
        _enable_reflection([*names, health_name], server)
        self.port = self._bind(server)
        await server.start()
        for name in ("", *names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        if self.settings.metrics_port is not None:
            self._metrics = MetricsEndpoint(self.registry, self.settings.host, self.settings.metrics_port)
        log.info("serving", address=self.address, services=names, tls=self.settings.tls_cert_file is not None)
        if self.settings.ready_file is not None:  # a reader sees the whole file or no file
            lines = [self.address]
            if self.metrics_port is not None:
                lines.append(f"metrics {join_host_port(self.settings.host, self.metrics_port)}")
            partial = self.settings.ready_file.with_name(self.settings.ready_file.name + ".partial")
            partial.write_text("\n".join(lines) + "\n")
            partial.replace(self.settings.ready_file)
        for hook in self.on_start:
            await hook()
        return self.port

    @property
    def address(self) -> str:
        return join_host_port(self.settings.host, self.port)

    @property
    def metrics_port(self) -> int | None:
        """The port `/metrics` is served on once started, if `metrics_port` is set."""
        return None if self._metrics is None else self._metrics.port

    def _bind(self, server: grpc.aio.Server) -> int:
        address = join_host_port(self.settings.host, self.settings.port)
        s = self.settings
        if s.tls_cert_file is None or s.tls_key_file is None:
            port = server.add_insecure_port(address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(s.tls_key_file.read_bytes(), s.tls_cert_file.read_bytes())],
                root_certificates=s.tls_client_ca_file.read_bytes() if s.tls_client_ca_file else None,
                require_client_auth=s.tls_client_ca_file is not None,
            )
            port = server.add_secure_port(address, credentials)
        if port == 0:
            raise OSError(f"could not bind {address}")
        return port

    async def set_not_serving(self, reason: str) -> None:
        """Report NOT_SERVING on every service, for good, while calls are still answered: for a server
        whose core can no longer work, so that probes and clients stop sending it work."""
        log.error("not serving", reason=reason)
        await self._health.enter_graceful_shutdown()  # later status changes are then ignored

    async def set_ready(self, ready: bool, reason: str = "") -> None:
        """Report the server as a whole (health service `""`) SERVING or NOT_SERVING, for a server
        that cannot work while a service it needs is away; its named services stay SERVING (it is
        alive and answers), which is what a liveness probe should ask. Ignored once draining."""
        if ready:
            log.info("ready again")
        else:
            log.warning("not ready", reason=reason)
        status = (
            health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set("", status)

    async def stop(self, grace: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new calls, let calls in flight finish within `grace`
        (default `drain_seconds`), cancel the rest, then release resources."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await self._health.enter_graceful_shutdown()
        for hook in self.on_drain:
            await hook()
        grace = self.settings.drain_seconds if grace is None else grace
        log.info("draining", grace_s=grace)
        await server.stop(grace)
        for hook in self.on_close:
            await hook()
        if self._metrics is not None:
            self._metrics.stop()
        log.info("stopped")

    async def serve_until_signal(self) -> None:
        """Start, serve until SIGTERM or SIGINT, then drain and stop."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()


def run_service(
    name: str,
    settings_cls: type[ServiceSettings],
    build: Callable[[Any], Awaitable[GrpcServer]],
    argv: list[str],
) -> None:
    """The whole `python -m pipelinerl.<service>` entry point: `[--config FILE] [--flags]` into
    settings, logging, then serve until SIGTERM or Ctrl-C. `build` runs inside the event loop, since
    gRPC channels and asyncio primitives belong to the loop that creates them."""
    config_file, cli_args = split_config_flag(argv)
    settings = settings_cls.load(config_file, cli_args)
    configure_logging(name, settings.log_format, settings.log_level)

    async def serve() -> None:
        server = await build(settings)
        await server.serve_until_signal()

    asyncio.run(serve())
