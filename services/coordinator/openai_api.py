"""The chat-completions API's shapes, both ways: a request body into a `ChatRequest` (or an
`ApiError` naming the field, in OpenAI's error shape), and an answer into a `chat.completion` or
the `chat.completion.chunk` events of a stream.

Honoured: `messages` (system, developer, user, assistant with `tool_calls`, tool; text content or
text parts), `tools` (functions), `tool_choice` `auto`, `max_tokens`/`max_completion_tokens`,
`temperature`, `top_p`, `stop`, `n` 1, `logprobs`, `stream` with `stream_options.include_usage`,
`seed` (ignored: the run seeds its engines). Refused (400): `n` above 1, `top_logprobs` above 0,
`tool_choice` other than `auto`, a `response_format` other than text, nonzero penalties and
`logit_bias` (they would change the distribution the logprobs describe), images and audio.
Ignored: every other field (`model`, `user`, `metadata`, `parallel_tool_calls`, `store`, ...).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.environment.types import Message, Role, Tool, ToolCall
from pipelinerl.environment.validation import TOOL_NAME_PATTERN

MAX_STOP = 4
"""Most stop strings of one request, as OpenAI's API takes."""
_ROLES = {"system": Role.SYSTEM, "developer": Role.SYSTEM, "user": Role.USER, "assistant": Role.ASSISTANT}


class ApiError(Exception):
    """A refused request, as OpenAI's API answers one: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, f"{param}: {message}", param, code)


@dataclass(frozen=True)
class ChatRequest:
    """What one call asks, in the coordinator's terms; None where the run's default applies."""

    model: str
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...]
    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...]
    logprobs: bool
    stream: bool
    include_usage: bool


def parse_request(body: object) -> ChatRequest:
    """`body` (decoded JSON) as a ChatRequest; ApiError 400 naming the first wrong field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_body")
    _refuse_unsupported(body)
    stream_options = _optional(body, "stream_options", dict) or {}
    tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if tokens is not None and (not _is_int(tokens) or tokens < 1):
        raise _bad(param, f"is {tokens!r}; it must be an integer of 1 or more")
    return ChatRequest(
        model=str(body.get("model") or ""),
        messages=_messages(body.get("messages")),
        tools=_tools(body.get("tools")),
        max_new_tokens=tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        stop=_stop(body.get("stop")),
        logprobs=bool(_optional(body, "logprobs", bool)),
        stream=bool(_optional(body, "stream", bool)),
        include_usage=bool(_optional(stream_options, "include_usage", bool)),
    )


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    unsupported = "unsupported_value"
    n = body.get("n")
    if n is not None and n != 1:
        raise _bad("n", f"is {n!r}; this endpoint samples one choice per call", unsupported)
    if body.get("top_logprobs"):
        raise _bad(
            "top_logprobs", "is not supported: engines report the sampled token's logprob", unsupported
        )
    choice = body.get("tool_choice")
    if choice not in (None, "auto"):
        raise _bad("tool_choice", f"is {choice!r}; only 'auto' (the model is not constrained)", unsupported)
    response_format = body.get("response_format")
    if response_format is not None and (
        not isinstance(response_format, dict) or response_format.get("type") != "text"
    ):
        raise _bad("response_format", "only {'type': 'text'} is supported", unsupported)
    changes = "would change the distribution the recorded logprobs describe"
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0):
            raise _bad(name, f"must be 0: a penalty {changes}", unsupported)
    if body.get("logit_bias"):
        raise _bad("logit_bias", f"is not supported: it {changes}", unsupported)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(body: Mapping[str, Any], name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise _bad(name, f"must be a {kind.__name__}", "invalid_type")
    return value


def _number(
    body: Mapping[str, Any], name: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, f"is {value!r}; it must be a number", "invalid_type")
    if not (low < value if low_open else low <= value) or value > high:
        raise _bad(name, f"is {value}; it must be from {low} to {high}")
    return float(value)


def _stop(value: object) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "must be a string or a list of non-empty strings", "invalid_type")
    if len(stops) > MAX_STOP:
        raise _bad("stop", f"holds {len(stops)} strings; at most {MAX_STOP}")
    return tuple(stops)


def _text(content: object, param: str) -> str:
    """Text content, or the text of its parts (`[{"type": "text", "text": ...}]`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(param, "must be a string or a list of text parts", "invalid_type")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"{param}[{index}]", "only text parts are supported", "unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


def _messages(value: object) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "must be a non-empty list of messages", "invalid_type")
    out: list[Message] = []
    names: dict[str, str] = {}  # call id → tool name, for the tool messages that answer it
    for index, item in enumerate(value):
        param = f"messages[{index}]"
        if not isinstance(item, dict):
            raise _bad(param, "must be an object", "invalid_type")
        role = item.get("role")
        content = _text(item.get("content"), f"{param}.content")
        if role == "tool":
            call_id = item.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{param}.tool_call_id", "a tool message names the call it answers", "missing")
            out.append(Message(Role.TOOL, content, tool_call_id=call_id, name=names.get(call_id, "")))
            continue
        if role not in _ROLES:
            raise _bad(f"{param}.role", f"is {role!r}; one of system, developer, user, assistant, tool")
        calls = _tool_calls(item.get("tool_calls"), f"{param}.tool_calls") if role == "assistant" else ()
        names |= {c.id: c.name for c in calls}
        out.append(Message(_ROLES[role], content, calls))
    return tuple(out)


def _tool_calls(value: object, param: str) -> tuple[ToolCall, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad(param, "must be a list", "invalid_type")
    calls = []
    for index, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _bad(f"{param}[{index}].function", "a tool call names its function", "missing")
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            raise _bad(f"{param}[{index}].function.arguments", "must be JSON text", "invalid_type")
        calls.append(ToolCall(str(call.get("id") or f"call-{index}"), function["name"], arguments))
    return tuple(calls)


def _tools(value: object) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _bad("tools", "must be a list", "invalid_type")
    tools = []
    for index, tool in enumerate(value):
        param = f"tools[{index}]"
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict):
            raise _bad(param, "must be {'type': 'function', 'function': {...}}", "invalid_type")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME_PATTERN.fullmatch(name):
            raise _bad(f"{param}.function.name", "must be 1 to 64 characters of [A-Za-z0-9_-]")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise _bad(f"{param}.function.parameters", "must be a JSON Schema object", "invalid_type")
        tools.append(Tool(name, str(function.get("description") or ""), parameters))
    return tuple(tools)


@dataclass(frozen=True)
class Answer:
    """One call's answer: the turn as the model sampled it and as it reads."""

    completion_id: str
    model: str
    message: Message
    finish_reason: FinishReason
    tokens: TokenSequence
    token_texts: tuple[str, ...]
    """Each sampled token's text, for `logprobs`."""
    prompt_tokens: int
    logprobs: bool

    @property
    def finish(self) -> str:
        if self.finish_reason is FinishReason.LENGTH:
            return "length"
        return "tool_calls" if self.message.tool_calls else "stop"

    def usage(self) -> dict[str, int]:
        completion = len(self.tokens)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def _logprobs(self) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {
            "content": [
                {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
                for text, logprob in zip(self.token_texts, self.tokens.logprobs, strict=True)
            ],
            "refusal": None,
        }

    def _calls(self) -> list[dict[str, Any]]:
        return [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in self.message.tool_calls
        ]

    def _header(self, kind: str) -> dict[str, Any]:
        version = self.tokens.versions[-1] if self.tokens.versions else 0
        return {
            "id": self.completion_id,
            "object": kind,
            "created": int(time.time()),
            "model": self.model,
            "system_fingerprint": f"pipelinerl-v{version}",
        }

    def completion(self) -> dict[str, Any]:
        """The `chat.completion` object."""
        message: dict[str, Any] = {"role": "assistant", "content": self.message.content, "refusal": None}
        if self.message.tool_calls:
            message["tool_calls"] = self._calls()
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(), "finish_reason": self.finish}
        return {**self._header("chat.completion"), "choices": [choice], "usage": self.usage()}

    def events(self, include_usage: bool) -> Iterator[str]:
        """The server-sent events of a stream: the role and content, each tool call, the finish
        reason, the usage if asked, and `[DONE]`."""
        header = self._header("chat.completion.chunk")

        def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            extra = {"usage": None} if include_usage else {}
            return _event({**header, "choices": [choice], **extra})

        yield chunk(
            {"role": "assistant", "content": self.message.content, "refusal": None}, None, self._logprobs()
        )
        for index, call in enumerate(self._calls()):
            yield chunk({"tool_calls": [{"index": index, **call}]})
        yield chunk({}, self.finish)
        if include_usage:
            yield _event({**header, "choices": [], "usage": self.usage()})
        yield "data: [DONE]\n\n"


def _event(data: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"
