"""Client channels to PipelineRL services: deadlines, retries of UNAVAILABLE with backoff, bearer
token and TLS, the same message-size limit as the servers, and the caller's trace ids (trace.py).

Retries use gRPC's own retry policy (service config), so they apply to every method, including the
start of streams, and respect the call's deadline. Unary calls without an explicit `timeout=` get
`default_timeout_s`; long-lived streams are left without a deadline and end by cancellation, or
with UNAVAILABLE once keepalive pings find the server gone (keepalive.py).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import grpc
from grpc.aio import ClientCallDetails
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pipelinerl.common import trace
from pipelinerl.common.keepalive import Keepalive
from pipelinerl.common.server import channel_options
from pipelinerl.common.settings import DEFAULT_MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class ChannelConfig:
    """How to reach one service."""

    address: str
    """`host:port` of the service."""
    auth_token: str | None = None
    """Bearer token the server expects, if any."""
    tls_ca_file: Path | None = None
    """PEM CA bundle to verify the server with; set to use TLS."""
    tls_cert_file: Path | None = None
    """Client certificate for mutual TLS."""
    tls_key_file: Path | None = None
    """Private key of `tls_cert_file`."""
    default_timeout_s: float = 30.0
    """Deadline of unary calls that pass none."""
    max_attempts: int = 5
    """Attempts of a call that fails with UNAVAILABLE (1 = no retry)."""
    initial_backoff_s: float = 0.1
    """First retry delay; doubles each attempt up to `max_backoff_s` (gRPC adds jitter)."""
    max_backoff_s: float = 5.0
    """Longest retry delay."""
    max_reconnect_backoff_s: float | None = None
    """Longest wait between two attempts to connect to a server that is down; None: `max_backoff_s`.
    Set it low where a restarted server must be found again at once."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message sent or received."""
    keepalive: Keepalive = field(default_factory=Keepalive)
    """Pings that find a frozen or unreachable server (keepalive.py): the calls on its connection
    then fail UNAVAILABLE, streams included, instead of waiting on it forever."""


def _max_reconnect_backoff_s(config: ChannelConfig) -> float:
    return config.max_backoff_s if config.max_reconnect_backoff_s is None else config.max_reconnect_backoff_s


def _service_config(config: ChannelConfig) -> str:
    retry = {
        "maxAttempts": config.max_attempts,
        "initialBackoff": f"{config.initial_backoff_s}s",
        "maxBackoff": f"{config.max_backoff_s}s",
        "backoffMultiplier": 2,
        "retryableStatusCodes": ["UNAVAILABLE"],
    }
    policy: dict[str, Any] = {"name": [{}]}
    if config.max_attempts > 1:
        policy["retryPolicy"] = retry
    return json.dumps({"methodConfig": [policy]})


class _DefaultsInterceptor(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the bearer token, the trace ids and, for unary calls without one, the default deadline."""

    def __init__(self, config: ChannelConfig) -> None:
        self._config = config

    async def intercept_unary_unary(
        self,
        continuation: Callable[[ClientCallDetails, Any], Awaitable[grpc.aio.UnaryUnaryCall]],
        client_call_details: ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryUnaryCall:
        timeout = client_call_details.timeout
        details = _replace(
            client_call_details,
            timeout=self._config.default_timeout_s if timeout is None else timeout,
            metadata=_with_metadata(client_call_details.metadata, self._config.auth_token),
        )
        return await continuation(details, request)


class _StreamDetails:
    """Adds the bearer token, if any, and the trace ids to a stream's metadata."""

    def __init__(self, token: str | None) -> None:
        self._token = token

    def _details(self, details: ClientCallDetails) -> ClientCallDetails:
        metadata = _with_metadata(details.metadata, self._token)
        return _replace(details, timeout=details.timeout, metadata=metadata)


# One class per call type: grpc.aio files an interceptor under the first call type it is an
# instance of (an if/elif chain), so one class for several types would see only one of them.
class _UnaryStreamDetails(_StreamDetails, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self,
        continuation: Callable[[ClientCallDetails, Any], Awaitable[grpc.aio.UnaryStreamCall]],
        client_call_details: ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryStreamCall:
        return await continuation(self._details(client_call_details), request)


class _StreamUnaryDetails(_StreamDetails, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self,
        continuation: Callable[[ClientCallDetails, Any], Awaitable[grpc.aio.StreamUnaryCall]],
        client_call_details: ClientCallDetails,
        request_iterator: Any,
    ) -> grpc.aio.StreamUnaryCall:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStreamDetails(_StreamDetails, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self,
        continuation: Callable[[ClientCallDetails, Any], Awaitable[grpc.aio.StreamStreamCall]],
        client_call_details: ClientCallDetails,
        request_iterator: Any,
    ) -> grpc.aio.StreamStreamCall:
        return await continuation(self._details(client_call_details), request_iterator)


def _replace(
    details: ClientCallDetails, *, timeout: float | None, metadata: grpc.aio.Metadata | None
) -> ClientCallDetails:
    """`details` with a new timeout and metadata: the namedtuple's `_replace`, spelt out because
    typeshed's grpc stubs declare ClientCallDetails as a plain class."""
    return ClientCallDetails(
        method=details.method,
        timeout=timeout,
        metadata=metadata,
        credentials=details.credentials,
        wait_for_ready=details.wait_for_ready,
    )


def _with_metadata(metadata: Any, token: str | None) -> grpc.aio.Metadata | None:
    added = trace.outgoing()
    if token is not None:
        added.append(("authorization", f"Bearer {token}"))
    if not added:
        return metadata
    merged = grpc.aio.Metadata(*(tuple(metadata) if metadata else ()))
    for key, value in added:
        merged.add(key, value)
    return merged


def open_channel(config: ChannelConfig | str) -> grpc.aio.Channel:
    """An asyncio channel to one service (pass a `host:port` string for all defaults)."""
    if isinstance(config, str):
        config = ChannelConfig(address=config)
    options = [
        *channel_options(config.max_message_bytes),
        *config.keepalive.client_options(),
        ("grpc.enable_retries", 1),
        # gRPC's own reconnect backoff grows to minutes by default; a restarted peer should be
        # found again within the same bound as retries, or `max_reconnect_backoff_s`.
        ("grpc.initial_reconnect_backoff_ms", int(config.initial_backoff_s * 1000)),
        ("grpc.min_reconnect_backoff_ms", int(config.initial_backoff_s * 1000)),
        ("grpc.max_reconnect_backoff_ms", int(_max_reconnect_backoff_s(config) * 1000)),
        ("grpc.service_config", _service_config(config)),
    ]
    token = config.auth_token
    interceptors: list[grpc.aio.ClientInterceptor] = [
        _DefaultsInterceptor(config),
        _UnaryStreamDetails(token),
        _StreamUnaryDetails(token),
        _StreamStreamDetails(token),
    ]
    if config.tls_ca_file is None:
        return grpc.aio.insecure_channel(config.address, options=options, interceptors=interceptors)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=config.tls_ca_file.read_bytes(),
        private_key=config.tls_key_file.read_bytes() if config.tls_key_file else None,
        certificate_chain=config.tls_cert_file.read_bytes() if config.tls_cert_file else None,
    )
    return grpc.aio.secure_channel(config.address, credentials, options=options, interceptors=interceptors)


class ServiceClient:
    """Base of the typed clients: owns one channel; use as `async with Client(address) as c`."""

    def __init__(self, config: ChannelConfig | str) -> None:
        self._channel = open_channel(config)

    async def close(self) -> None:
        await self._channel.close()

    async def serving(self, timeout_s: float = 2.0) -> bool:
        """Whether the server's grpc.health.v1 says SERVING; False when it cannot be asked."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            response = await stub.Check(  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's HealthStub omits the methods its __init__ sets
                health_pb2.HealthCheckRequest(), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return response.status == health_pb2.HealthCheckResponse.SERVING

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (for a child process to bind)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
