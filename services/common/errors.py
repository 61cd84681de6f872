"""Domain errors raised by the pure cores; `pipelinerl.common.status` maps them to gRPC codes.

Cores never import grpc. They raise one of these, and the servicer turns it into a status with
`google.rpc` details, so a client in any language learns which field of which item was wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request: `field` is a dotted path such as `items[3].answer`."""

    field: str
    description: str


class PipelineError(Exception):
    """Base of every domain error. `code` names the gRPC status code it maps to."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(PipelineError):
    """The request is malformed; retrying it unchanged fails again."""

    code = "INVALID_ARGUMENT"

    def __init__(self, message: str, violations: list[FieldViolation] | None = None) -> None:
        super().__init__(message)
        self.violations = list(violations or [])

    @classmethod
    def field(cls, field: str, description: str) -> InvalidArgument:
        """The common case: one field is wrong."""
        return cls(f"{field}: {description}", [FieldViolation(field, description)])

    def under(self, parent: str) -> InvalidArgument:
        """The same error with each field path rooted at `parent` (the message that holds the part
        that was checked), so that paths always start at the request message's root."""
        violations = [FieldViolation(f"{parent}.{v.field}", v.description) for v in self.violations]
        if len(violations) == 1:
            return InvalidArgument.field(violations[0].field, violations[0].description)
        return InvalidArgument(self.message, violations)


class ResourceExhausted(PipelineError):
    """A queue, a capacity or a size limit is full; retry later or send less."""

    code = "RESOURCE_EXHAUSTED"


class FailedPrecondition(PipelineError):
    """The system is not in the state the request needs (for example, a weight version it no longer has)."""

    code = "FAILED_PRECONDITION"


class NotFound(PipelineError):
    """The named entity (run, version, request) does not exist."""

    code = "NOT_FOUND"


class DeadlineExceeded(PipelineError):
    """The work did not finish in the time it was given."""

    code = "DEADLINE_EXCEEDED"


class Unavailable(PipelineError):
    """The service is going away or a dependency is down; retrying later can succeed."""

    code = "UNAVAILABLE"


@dataclass
class ErrorInfo:
    """A per-item error inside a batch response (the batch itself succeeded)."""

    code: str
    message: str
    violations: list[FieldViolation] = field(default_factory=list)

    @classmethod
    def from_exception(cls, exc: PipelineError) -> ErrorInfo:
        return cls(exc.code, exc.message, list(getattr(exc, "violations", [])))
