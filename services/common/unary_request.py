"""A call to a unary-request method that ends without its request message is answered.

grpcio's asyncio server (1.85.1) leaves such a call open for good: `_handle_unary_unary_rpc` and
`_handle_unary_stream_rpc` return without a status when reading the request gives nothing, taking
it for a call the client cancelled, while the call waits for that status until the client gives up.
The client need not have cancelled: its request stream may have ended (END_STREAM) with no message,
or on a message whose length prefix promises more bytes than arrive, whose partial bytes gRPC's
HTTP/2 transport drops as it reports the end. A bare server with one method shows it:

    async def ok(request, context): return b"ok"
    server = grpc.aio.server(); server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"M": grpc.unary_unary_rpc_method_handler(ok)}),)); ...
    await channel.stream_unary("/t.T/M")(iter([]), timeout=3)  # DEADLINE_EXCEEDED after 3 s

and so does raw HTTP/2 (HEADERS, then 10 bytes of a 100-byte message in a DATA frame with
END_STREAM): no answer on a unary-unary or unary-stream method; trailers at once from grpcio's
threaded server (UNIMPLEMENTED) and on a request-streaming method (OK: a stream of no message).
Hence the guard: every unary-request method is served as a request stream whose first message is
read here, a missing one answered INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from pipelinerl.common.handlers import Continuation, stream_responses

NO_REQUEST = "the call ended without its request message (none was sent, or it was cut short)"


class UnaryRequestInterceptor(grpc.aio.ServerInterceptor):
    """Serves each unary-request method as a request stream that reads one message. The outermost
    interceptor, so the others still see the method's own arity (its metrics type label)."""

    async def intercept_service(
        self, continuation: Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        serde = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.response_streaming:
            assert handler.unary_stream is not None
            return grpc.stream_stream_rpc_method_handler(_one_request_stream(handler.unary_stream), **serde)
        assert handler.unary_unary is not None
        return grpc.stream_unary_rpc_method_handler(_one_request_unary(handler.unary_unary), **serde)


async def _request(context: grpc.aio.ServicerContext) -> Any:
    request = await context.read()
    if request is grpc.aio.EOF:  # pyright: ignore[reportAttributeAccessIssue]  # typeshed's grpc.aio omits EOF, which grpcio exports
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, NO_REQUEST)
    return request


def _one_request_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def unary(_: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return await behavior(await _request(context), context)

    return unary


def _one_request_stream(behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
    async def stream(_: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in stream_responses(behavior, await _request(context), context):
            yield response

    return stream
