"""Messages and tools in the shape of OpenAI's chat-completions API, as JSON values: what a chat
template reads (`coordinator.chat_render`) and what an agent sends (`builtin.agents`)."""

from __future__ import annotations

import json
from typing import Any

from pipelinerl.environment.types import Message, Role, Tool


def tool_to_openai(tool: Tool) -> dict[str, Any]:
    """`tool` in the OpenAI function shape, as plain JSON values."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": json.loads(json.dumps(tool.parameters)),
        },
    }


def message_to_openai(message: Message) -> dict[str, Any]:
    """`message` as a chat-completions request holds it; an assistant's tool-call arguments as the
    JSON text the model wrote."""
    out: dict[str, Any] = {"role": message.role.value, "content": message.content}
    if message.role is Role.ASSISTANT and message.tool_calls:
        out["tool_calls"] = [
            {"type": "function", "id": c.id, "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.role is Role.TOOL:
        out["tool_call_id"] = message.tool_call_id
    return out
