"""Building blocks of the server interceptors: a method handler rebuilt with its behaviour wrapped,
whatever its arity (unary or streaming, either way)."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any

import grpc

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]
"""What a server interceptor calls to get the next handler: None for a method no service has."""


def wrap_behavior(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[Callable[..., Awaitable[Any]]], Callable[..., Awaitable[Any]]],
    wrap_stream: Callable[[Callable[..., Any]], Callable[..., Any]],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """Rebuild `handler` with its behaviour wrapped, keeping its arity, its response serializer and,
    unless another is given, its request deserializer."""
    serde = {
        "request_deserializer": request_deserializer or handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    # grpc sets exactly the behaviour that matches the handler's arity; the others are None. Its
    # types describe the sync server's behaviours (a stream is an Iterator), while the aio server's
    # are coroutines and async generators: hence `wrap_stream`'s loose `Callable[..., Any]`.
    if handler.request_streaming and handler.response_streaming:
        assert handler.stream_stream is not None
        return grpc.stream_stream_rpc_method_handler(wrap_stream(handler.stream_stream), **serde)
    if handler.request_streaming:
        assert handler.stream_unary is not None
        return grpc.stream_unary_rpc_method_handler(wrap_unary(handler.stream_unary), **serde)
    if handler.response_streaming:
        assert handler.unary_stream is not None
        return grpc.unary_stream_rpc_method_handler(wrap_stream(handler.unary_stream), **serde)
    assert handler.unary_unary is not None
    return grpc.unary_unary_rpc_method_handler(wrap_unary(handler.unary_unary), **serde)


async def stream_responses(behavior: Callable[..., Any], request: Any, context: Any) -> AsyncIterator[Any]:
    """The responses of a streaming behaviour, also of one that writes them itself with
    `context.write` and returns nothing (grpc's health Watch)."""
    responses = behavior(request, context)
    if inspect.isawaitable(responses):
        await responses
        return
    async for response in responses:
        yield response


def wrap_calls(
    handler: grpc.RpcMethodHandler,
    around: Callable[[grpc.aio.ServicerContext], AbstractContextManager[object]],
) -> grpc.RpcMethodHandler:
    """`handler` with each of its calls, a stream's until its last response, run inside
    `around(context)`."""

    def wrap_unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with around(context):
                return await behavior(request, context)

        return unary

    def wrap_stream(behavior: Callable[..., Any]) -> Callable[..., AsyncIterator[Any]]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            with around(context):
                async for response in stream_responses(behavior, request, context):
                    yield response

        return stream

    return wrap_behavior(handler, wrap_unary, wrap_stream)
