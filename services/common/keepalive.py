"""HTTP/2 keepalive: how every connection between services finds its peer gone when the peer
sends nothing to say so.

A peer frozen (SIGSTOP, a VM paused) or cut off by the network keeps its TCP connection open —
the kernel still acks, or nothing arrives at all — so a long-lived stream on it (Generate,
SubmitSamples, WatchWeights) and a unary call without a short deadline would wait forever. Each
side therefore pings the other every `time_s`; a ping not acked within `timeout_s` closes the
connection, every call on it fails UNAVAILABLE, and the caller sends its work elsewhere or opens a
new stream once the peer answers again. A dead peer is thus found within `time_s + timeout_s`.

Pings are answered by gRPC's own I/O threads, not by the service's code, so they say the process
runs and the network carries, not that the service makes progress: a service whose event loop or
engine hangs is the business of its health checks.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MIN_PING_INTERVAL_S = 1.0
"""The most often a client may be set to ping. Servers accept pings twice as often, so that timer
jitter never makes a client at the limit look abusive; more often still, a server counts a strike
per ping and ends the connection (GOAWAY `too_many_pings`) on the third."""


class Keepalive(BaseModel):
    """Keepalive pings of one side of a connection (a client channel, or a server to its clients)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    time_s: float = Field(default=2.0, ge=MIN_PING_INTERVAL_S)
    """Seconds between two pings on a connection, whether calls are open on it or not."""
    timeout_s: float = Field(default=3.0, gt=0)
    """A ping not acked within this closes the connection (its calls fail UNAVAILABLE)."""

    def client_options(self) -> list[tuple[str, int]]:
        return [*self._pinging(), ("grpc.keepalive_permit_without_calls", 1)]

    def server_options(self) -> list[tuple[str, int]]:
        """The server pings its clients too (a frozen client's streams end), and accepts their
        pings, also on a connection without calls: by default it would count a ping more often
        than every 5 minutes, or any without calls, as abuse."""
        return [
            *self._pinging(),
            ("grpc.keepalive_permit_without_calls", 1),
            # The C name is GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS; this is its key.
            ("grpc.http2.min_ping_interval_without_data_ms", int(MIN_PING_INTERVAL_S * 500)),
            ("grpc.http2.max_ping_strikes", 2),
        ]

    def _pinging(self) -> list[tuple[str, int]]:
        timeout_ms = int(self.timeout_s * 1000)
        return [
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            # gRPC 1.85's transport closes a connection on an unacked ping after the ping timeout
            # (60 s by default) and never acts on keepalive_timeout_ms alone.
            ("grpc.http2.ping_timeout_ms", timeout_ms),
            # By default only two pings go out while no data does: an idle stream (WatchWeights
            # between versions) would stop being checked.
            ("grpc.http2.max_pings_without_data", 0),
        ]
