"""Domain errors <-> gRPC status with google.rpc details, in one place for every service.

Servers: `rpc_status(exc)` for a whole call (abort), `item_status(exc)` for one item of a batch or
stream. Clients: `error_from_rpc(err)` turns an `AioRpcError` back into the domain error, field
violations included, so Python callers catch `InvalidArgument` rather than parse strings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status as grpc_rpc_status

from pipelinerl.common import errors
from pipelinerl.common.errors import ErrorInfo, FieldViolation, PipelineError

_ERRORS_BY_CODE: dict[str, type[PipelineError]] = {
    cls.code: cls
    for cls in (
        errors.InvalidArgument,
        errors.ResourceExhausted,
        errors.FailedPrecondition,
        errors.NotFound,
        errors.DeadlineExceeded,
        errors.Unavailable,
    )
}


def status_proto(info: ErrorInfo) -> status_pb2.Status:
    """A google.rpc.Status, with a BadRequest detail when fields were named."""
    status = status_pb2.Status(code=code_pb2.Code.Value(info.code), message=info.message)
    if info.violations:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
                for v in info.violations
            ]
        )
        detail = any_pb2.Any()
        detail.Pack(bad_request)
        status.details.append(detail)
    return status


def item_status(exc: PipelineError) -> status_pb2.Status:
    """Status of one failed item inside a response that otherwise succeeded."""
    return status_proto(ErrorInfo.from_exception(exc))


def ok_status() -> status_pb2.Status:
    return status_pb2.Status(code=code_pb2.OK)


def rpc_status(exc: PipelineError) -> grpc.Status:
    """Status to abort a whole call with: `await context.abort_with_status(rpc_status(exc))`."""
    return grpc_rpc_status.to_status(item_status(exc))


def info_from_status(status: status_pb2.Status) -> ErrorInfo | None:
    """The domain view of a google.rpc.Status; None when it is OK."""
    if status.code == code_pb2.OK:
        return None
    violations: list[FieldViolation] = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            violations += [FieldViolation(v.field, v.description) for v in bad_request.field_violations]
    # A code outside google.rpc.Code (a newer or broken peer) reads as UNKNOWN, as gRPC's own do.
    name = code_pb2.Code.Name(status.code) if status.code in code_pb2.Code.values() else "UNKNOWN"
    return ErrorInfo(name, status.message, violations)


def error_from_status(status: status_pb2.Status) -> PipelineError:
    """The domain error a non-OK google.rpc.Status stands for (field violations kept)."""
    info = info_from_status(status) or ErrorInfo("UNKNOWN", "status is OK")
    cls = _ERRORS_BY_CODE.get(info.code, PipelineError)
    if cls is errors.InvalidArgument:
        return errors.InvalidArgument(info.message, info.violations)
    exc = cls(info.message)
    exc.code = info.code
    return exc


def error_from_rpc(err: grpc.aio.AioRpcError) -> PipelineError:
    """The domain error of a failed call, from its rich status when the server sent one."""
    # from_call reads only code(), details() and trailing_metadata(), which an AioRpcError has
    status = grpc_rpc_status.from_call(err)  # pyright: ignore[reportArgumentType]  # typed for grpc.Call
    if status is None:
        status = status_pb2.Status(code=err.code().value[0], message=err.details() or "")
    return error_from_status(status)


@contextlib.contextmanager
def domain_errors() -> Iterator[None]:
    """In clients: `with domain_errors(): await stub.Call(...)` raises the domain error of a failed call."""
    try:
        yield
    except grpc.aio.AioRpcError as err:
        raise error_from_rpc(err) from err
