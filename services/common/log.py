"""structlog set-up shared by every service: JSON lines for machines, colours for people.

Context (service, run, weight version, request id) is bound with `bind_context`, which uses
contextvars, so a value bound inside one request handler or task does not leak into another.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import structlog

LogFormat = Literal["json", "console"]


def configure_logging(service: str, fmt: LogFormat = "console", level: str = "info") -> None:
    """Route structlog (and stdlib logging, which grpc and transformers use) to stderr."""
    renderer: Any = (
        structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    )
    numeric_level = logging.getLevelNamesMapping()[level.upper()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=numeric_level, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)


def _stderr_logger(*_: Any) -> structlog.PrintLogger:
    """A logger writing to `sys.stderr` as it is when a line is logged, not when logging was set
    up: a caller that swaps stderr for a while (a test capturing output) and closes it must not
    leave every later line raising on a closed file. Loggers are not cached, so each line asks."""
    return structlog.PrintLogger(sys.stderr)


def bind_context(**values: Any) -> None:
    """Bind run/version/request ids to every log line of the current task from now on."""
    structlog.contextvars.bind_contextvars(**values)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)
