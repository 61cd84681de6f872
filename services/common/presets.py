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


def not_a_model(source: str | Path) -> str:
    """Why `source` cannot be loaded: it names neither a preset nor a directory."""
    return f"{source} is neither a preset ({', '.join(PRESETS)}) nor a directory"
