"""The ids that let one attempt be followed across services: its run, group and sample (the
attempt's id; a sample is named after the attempt that made it).

    coordinator: bind_context(run=…, group_id=…, sample_id=…) ── every log line of the task carries them
        └─ a call made in that task sends them as metadata `pipelinerl-run`, `pipelinerl-group-id`, …
              └─ the server binds them for that call: its log lines carry them too

Messages that carry an id (a sample's `sample_id` and `group_id`, a request's `request_id`) are
logged with it; the metadata brings the ids a message lacks (the run and group of a Score call).
A Generate stream carries the requests of many groups, so each `Submission` carries its own ids in
its `trace` map (the same fields), which the inference server binds for that request.
"""

from __future__ import annotations

import grpc
import structlog

from pipelinerl.common.handlers import Continuation

FIELDS = ("run", "group_id", "sample_id")
"""The log fields that name an attempt, outermost first."""


def _key(field: str) -> str:
    return "pipelinerl-" + field.replace("_", "-")


_KEYS = {_key(field): field for field in FIELDS}


def bound() -> dict[str, str]:
    """The ids bound to the current task's log context, by field."""
    context = structlog.contextvars.get_contextvars()
    return {field: str(context[field]) for field in FIELDS if field in context}


def outgoing() -> list[tuple[str, str]]:
    """Metadata for a call made now: the ids bound to the current task's log context."""
    return [(_key(field), value) for field, value in bound().items()]


class TraceContextInterceptor(grpc.aio.ServerInterceptor):
    """Binds the ids a caller sent to the log context of its call (each call runs in a task of
    its own, so they stay with it)."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        sent = {
            _KEYS[key]: value
            for key, value in handler_call_details.invocation_metadata or ()
            if key in _KEYS and isinstance(value, str)
        }
        if sent:
            structlog.contextvars.bind_contextvars(**sent)
        return await continuation(handler_call_details)
