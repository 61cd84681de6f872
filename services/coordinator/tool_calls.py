"""How a chat template family writes tool calls, both ways: the text of a model's turn into its
content and tool calls, and a tool call into what the template expects to render it back.

    TaggedJson()        Qwen2.5 / Hermes: <tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>
    TaggedNameJson()    the presets' template: <call>add{"a":1}</call>
    BareJson()          Llama 3.x: the whole turn is {"name": "add", "parameters": {"a": 1}}

A call the syntax cannot read (a block that is not JSON, a tag never closed) is not an error: it
stays in the message's text, and the environment answers it as it answers any text. A call whose
name can be read but whose arguments are not JSON becomes a tool call with those arguments as the
model wrote them, for the environment to answer in-band (`ToolCall.json_arguments()` is None).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

MAX_TOOL_CALLS = 256
"""Most calls read from one turn (the environment contract's limit); later blocks stay text."""


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """JSON text, as the model wrote it where it can be cut out of the turn; possibly invalid."""


class ToolCallSyntax(Protocol):
    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """The turn's content (its text less the calls read) and the calls, in order."""
        ...

    def template_arguments(self, arguments: str) -> str | dict[str, Any]:
        """`arguments` as the chat template takes them to write the call back the way it was read."""
        ...


def _object_or_text(arguments: str) -> str | dict[str, Any]:
    """HF templates take arguments as a dict (they write it with `tojson`); text that is not a
    JSON object is passed as it is (the template then writes it quoted, and the turn does not
    render back as sampled: a fork)."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


@dataclass(frozen=True)
class NoToolCalls:
    """A template without tool calls: the whole turn is content."""

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        return text, []

    def template_arguments(self, arguments: str) -> str | dict[str, Any]:
        return _object_or_text(arguments)


class _Tagged:
    """Calls written between an opening and a closing tag, each preceded by `separator` (which the
    template writes before every call, so reading a call removes it once)."""

    open: str
    close: str
    separator: str

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        kept: list[str] = []
        calls: list[ParsedCall] = []
        position = 0
        while len(calls) < MAX_TOOL_CALLS:
            start = text.find(self.open, position)
            if start < 0:
                break
            end = text.find(self.close, start + len(self.open))
            if end < 0:
                break
            call = self._body(text[start + len(self.open) : end])
            before = text[position:start]
            if call is None:
                kept.append(text[position : end + len(self.close)])
            else:
                if self.separator and before.endswith(self.separator):
                    before = before[: -len(self.separator)]
                kept.append(before)
                calls.append(call)
            position = end + len(self.close)
        kept.append(text[position:])
        return "".join(kept), calls

    def _body(self, body: str) -> ParsedCall | None:
        raise NotImplementedError


_NAME_THEN_ARGUMENTS = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*)\}\s*', re.DOTALL
)


def _json_call(body: str) -> ParsedCall | None:
    """`{"name": ..., "arguments": ...}` (or "parameters"): the arguments' own text where it can be
    cut out, re-serialized where the object has other keys around it; the raw text when the body is
    no JSON but still starts with a name."""
    shaped = _NAME_THEN_ARGUMENTS.fullmatch(body)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        value = None
    if isinstance(value, dict) and isinstance(value.get("name"), str):
        arguments = value.get("arguments", value.get("parameters", {}))
        if shaped is not None:
            raw = shaped.group(2).strip()
            try:
                if json.loads(raw) == arguments:
                    return ParsedCall(value["name"], raw)
            except (ValueError, RecursionError):
                pass
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))
    if shaped is None:
        return None
    try:
        name = json.loads(f'"{shaped.group(1)}"')
    except (ValueError, RecursionError):
        return None
    return ParsedCall(name, shaped.group(2).strip())


@dataclass(frozen=True)
class TaggedJson(_Tagged):
    """Qwen2.5 and Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, each
    call after a newline."""

    open: str = "<tool_call>"
    close: str = "</tool_call>"
    separator: str = "\n"

    def _body(self, body: str) -> ParsedCall | None:
        return _json_call(body)

    def template_arguments(self, arguments: str) -> str | dict[str, Any]:
        return _object_or_text(arguments)


_NAME = re.compile(r"([A-Za-z0-9_.:-]{1,64})(.*)", re.DOTALL)


@dataclass(frozen=True)
class TaggedNameJson(_Tagged):
    """The presets' template: `<call>add{"a":1,"b":2}</call>`, the tool's name then its arguments'
    JSON, short enough for a character-level model. The template writes arguments given as text
    verbatim, so a call always renders back as sampled."""

    open: str = "<call>"
    close: str = "</call>"
    separator: str = ""

    def _body(self, body: str) -> ParsedCall | None:
        found = _NAME.fullmatch(body)
        return None if found is None else ParsedCall(found.group(1), found.group(2))

    def template_arguments(self, arguments: str) -> str | dict[str, Any]:
        return arguments


@dataclass(frozen=True)
class BareJson:
    """Llama 3.x (JSON-based tool calling): a turn that is one JSON object with a name and its
    "parameters" (or "arguments") is a call; any other turn is content."""

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        stripped = text.strip()
        call = _json_call(stripped) if stripped.startswith("{") else None
        return ("", [call]) if call is not None else (text, [])

    def template_arguments(self, arguments: str) -> str | dict[str, Any]:
        return _object_or_text(arguments)


def syntax_for_template(template: str) -> ToolCallSyntax:
    """The tool-call syntax a chat template writes, told by the tags it contains."""
    if "<call>" in template:
        return TaggedNameJson()
    if "<tool_call>" in template:
        return TaggedJson()
    if '"parameters": ' in template and "<|eot_id|>" in template:
        return BareJson()
    return NoToolCalls()
