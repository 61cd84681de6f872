"""Load the causal LM the inference engine serves: a local HF directory, or a built-in preset.

Presets are built offline and deterministically (no hub access): a Llama- or Qwen2-style config
with a character-level tokenizer (and its two tool-call tags) constructed in code. `export_preset`
writes one as a normal HF directory (config, safetensors, tokenizer.json), which
AutoModelForCausalLM, AutoTokenizer and vLLM load back.

    tiny        ~0.8M params, 4 layers, head_dim 32: tests and CPU end-to-end runs
    small       ~25M params, 8 layers, head_dim 64: big enough that batching matters (benchmarks)
    gpu-100m    ~104M params, 12 layers, head_dim 64: a `pipelinerl run --device cuda`
    qwen2-0.5b  ~358M params, 24 layers, head_dim 64: GPU benchmarks
    qwen2-1.5b  ~1.31B params, 28 layers, head_dim 128: GPU benchmarks

The qwen2 presets are Qwen2-shaped, the project's small vocabulary: Qwen2-0.5B's and -1.5B's
layers without their 151k-token embedding.

Head sizes are 32, 64 and 128 because vLLM's CPU attention only supports some head sizes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from pipelinerl.common.presets import PRESETS, not_a_model
from pipelinerl.common.tokenizer import build_tokenizer

# Wider than the usual 0.02 so that a random model's greedy output varies with the prompt instead of
# repeating one token, which makes equivalence tests meaningful.
PRESET_INIT_RANGE = 0.1


@dataclass(frozen=True)
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase


def preset_config(name: str, tokenizer: PreTrainedTokenizerBase) -> LlamaConfig | Qwen2Config:
    """The model config of preset `name`, sized to `tokenizer`'s vocabulary."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    shape = PRESETS[name]
    # Qwen2Config does not declare head_dim (it derives hidden_size / heads, as every preset has
    # it); passed anyway, it is kept, so `config.head_dim` reads the same for both families.
    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        initializer_range=PRESET_INIT_RANGE,
        tie_word_embeddings=True,
        pad_token_id=_token_id(tokenizer.pad_token_id),
        bos_token_id=_token_id(tokenizer.bos_token_id),
        eos_token_id=_token_id(tokenizer.eos_token_id),
    )
    return Qwen2Config(**fields) if shape.family == "qwen2" else LlamaConfig(**fields)


def _token_id(value: object) -> int | None:
    """A special token's id. transformers types it as whatever `convert_tokens_to_ids` can return,
    but for one token that is an int, or None when the tokenizer has no such token."""
    assert value is None or isinstance(value, int), value
    return value


def build_preset(name: str = "tiny", *, seed: int = 0, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Preset `name` with weights drawn from `seed`: the same seed gives the same weights."""
    tokenizer = build_tokenizer()
    return LoadedModel(_random_model(preset_config(name, tokenizer), seed, dtype), tokenizer)


def export_preset(directory: str | Path, name: str = "tiny", *, seed: int = 0) -> Path:
    """Write preset `name` to `directory` as an HF model directory and return its path."""
    directory = Path(directory)
    loaded = build_preset(name, seed=seed)
    loaded.model.save_pretrained(directory)
    loaded.tokenizer.save_pretrained(directory)
    # transformers 5 records the class as TokenizersBackend, a name the 4.x that vLLM pins cannot
    # resolve; PreTrainedTokenizerFast loads the same tokenizer.json under both.
    tokenizer_config = directory / "tokenizer_config.json"
    fields = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps(fields | {"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
    return directory


def load_model(
    source: str | Path,
    *,
    random_init: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a preset (by name) or a local HF directory, in eval mode on `device`.

    A preset name wins over a directory of the same name; pass `./tiny` to mean the directory.
    `random_init` keeps the directory's config and tokenizer but draws fresh weights from `seed`.
    """
    if str(source) in PRESETS:
        loaded = build_preset(str(source), seed=seed, dtype=dtype)
    else:
        loaded = _load_directory(Path(source), random_init=random_init, seed=seed, dtype=dtype)
    loaded.model.to(device).eval()  # pyright: ignore[reportArgumentType]  # transformers' @wraps(Module.to) reads as unbound
    return loaded


def _load_directory(directory: Path, *, random_init: bool, seed: int, dtype: torch.dtype) -> LoadedModel:
    if not directory.is_dir():
        raise FileNotFoundError(not_a_model(directory))
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    if random_init:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        return LoadedModel(_random_model(config, seed, dtype), tokenizer)
    model = AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=dtype, attn_implementation="sdpa"
    )
    return LoadedModel(model, tokenizer)


def _random_model(config: PreTrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    # Weight init draws from torch's global generator; fork it so seeding here leaves the caller's
    # random stream untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()
