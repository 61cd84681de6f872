"""The preset models by name and shape, torch-free, so that a launcher can check a model name
without loading torch; `pipelinerl.common.model` builds them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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


PRESETS: dict[str, PresetShape] = {
    "tiny": PresetShape(128, 384, 4, 4, 2, 32, 1024),
    "small": PresetShape(512, 1536, 8, 8, 4, 64, 2048),
}


def not_a_model(source: str | Path) -> str:
    """Why `source` cannot be loaded: it names neither a preset nor a directory."""
    return f"{source} is neither a preset ({', '.join(PRESETS)}) nor a directory"
