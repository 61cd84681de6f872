"""Ports a local run holds for its services from their first start to their last stop.

A service that dies is started again on the ports it bound, since its peers and Prometheus know it
by them. Had the kernel picked them (port 0), they would be free while it is down, and anything on
the machine could take one in between: another bind to port 0, an outgoing connection's local port.
The restart would then fail to bind, and every later one too for as long as the taker keeps it.

So the launcher binds each port itself first, with SO_REUSEPORT, and keeps that socket until the
service stops for good. The service binds the same port with SO_REUSEPORT too (gRPC does by default
on Linux; so does the `/metrics` endpoint), which the kernel allows to sockets of the same user; a
socket without it, an automatic port choice and an outgoing connection all pass the port by. The
held socket never listens, so every connection goes to the service. Runs started at once still
cannot race for a port: the kernel picks each one, as with port 0.
"""

from __future__ import annotations

import socket


def hold_port(host: str, port: int = 0) -> socket.socket:
    """A socket bound to `host`:`port` (a free port chosen by the kernel for 0) with SO_REUSEPORT,
    so that a service can bind the same port while it is held; close it when the service is done.
    OSError when the port is in use by a socket without SO_REUSEPORT or of another user."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    held = socket.socket(family, socket.SOCK_STREAM)
    try:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind((host.strip("[]"), port))
    except OSError:
        held.close()
        raise
    return held
