"""The preset models by name and shape, torch-free, so that a launcher can check a model name
without loading torch; `pipelinerl.common.model` builds them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class PresetShape:
    """The sizes that distinguish one preset from another; everything else is shared."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    family: Literal["llama", "qwen2"] = "llama"
    """The transformers architecture: Qwen2 adds biases to the q/k/v projections."""
    rope_theta: float = 10000.0


PRESETS: dict[str, PresetShape] = {
    "tiny": PresetShape(128, 384, 4, 4, 2, 32, 1024),
    "small": PresetShape(512, 1536, 8, 8, 4, 64, 2048),
    "gpu-100m": PresetShape(768, 3072, 12, 12, 4, 64, 2048),
    "qwen2-0.5b": PresetShape(896, 4864, 24, 14, 2, 64, 32768, "qwen2", 1e6),
    "qwen2-1.5b": PresetShape(1536, 8960, 28, 12, 2, 128, 32768, "qwen2", 1e6),
}
"""`gpu-100m` (~104M parameters) is Llama-shaped; `qwen2-*` are Qwen2-shaped, the project's small
vocabulary: Qwen2-0.5B's and Qwen2-1.5B's layers without their 151k-token embedding."""


CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for tool in tools or [] %}\n"
    "    {%- set tool = tool.function if tool.function is defined else tool %}\n"
    "    {%- set parameters = tool.parameters.properties if tool.parameters is defined"
    " and tool.parameters.properties is defined else {} %}\n"
    "    {{- 'F:' + tool.name + '(' + parameters | join(',') + ') ' + (tool.description or '') + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'assistant' %}\n"
    "        {{- 'A:' + (message.content or '') }}\n"
    "        {%- for call in message.tool_calls or [] %}\n"
    "            {%- set call = call.function if call.function is defined else call %}\n"
    "            {%- set arguments = call.arguments if call.arguments is string"
    " else call.arguments | tojson(separators=(',', ':')) %}\n"
    "            {{- '<call>' + call.name + arguments + '</call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- eos_token + '\\n' }}\n"
    "    {%- else %}\n"
    "        {{- {'system': 'S:', 'user': 'U:', 'tool': 'T:'}[message.role] + message.content + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- 'A:' }}\n"
    "{%- endif %}\n"
)
"""The presets' chat template, in the characters of their tokenizer and its two tool-call tags,
`<call>` and `</call>` (one token each). One line per tool (`F:add(a,b) a+b`), then one
per message: `S:`, `U:`, `T:` (a tool's result) and the model's `A:`; a model's turn ends with
`<eos>`, which the engine stops at, and its tool calls read `<call>add{"a":1,"b":2}</call>`
(`pipelinerl.coordinator.tool_calls.TaggedNameJson`):

    <bos>F:add(a,b) a+b
    U:347+582
    A:<call>add{"a":347,"b":582}</call><eos>
    T:929
    A:929<eos>
"""


def not_a_model(source: str | Path) -> str:
    """Why `source` cannot be loaded: it names neither a preset nor a directory."""
    return f"{source} is neither a preset ({', '.join(PRESETS)}) nor a directory"
