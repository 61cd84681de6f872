"""The built-in presets: deterministic, offline, and loadable back as a normal HF directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipelinerl.common.model import (
    PRESETS,
    build_preset,
    build_tokenizer,
    export_preset,
    load_model,
    preset_config,
)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_preset(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def test_same_seed_gives_the_same_weights() -> None:
    first, again, other = build_preset(seed=0), build_preset(seed=0), build_preset(seed=1)
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(tensor, again.model.state_dict()[name]), name
    assert not torch.equal(first.model.lm_head.weight, other.model.lm_head.weight)


def test_building_a_preset_leaves_the_global_random_stream_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_preset(seed=5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_use_head_sizes_vllm_cpu_supports(name: str) -> None:
    tokenizer = build_tokenizer()
    config = preset_config(name, tokenizer)
    assert config.head_dim in (32, 64, 128)
    assert config.num_attention_heads * config.head_dim == config.hidden_size
    assert config.vocab_size == len(tokenizer)


@pytest.mark.parametrize(
    ("name", "model_type", "params"),
    [
        ("gpu-100m", "llama", 103_906_560),
        ("qwen2-0.5b", "qwen2", 357_989_504),
        ("qwen2-1.5b", "qwen2", 1_310_497_280),
    ],
)
def test_gpu_presets_have_their_stated_shape_and_size(name: str, model_type: str, params: int) -> None:
    """Counted on the meta device: building the weights of the larger ones on CPU takes too long."""
    config = preset_config(name, build_tokenizer())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert (config.model_type, sum(p.numel() for p in model.parameters())) == (model_type, params)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    if model_type == "qwen2":
        assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
        assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_tokenizer_is_character_level_with_bos() -> None:
    tokenizer = build_tokenizer()
    ids = tokenizer("12 + 3 = 15\nok")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len("12 + 3 = 15\nok")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "12 + 3 = 15\nok"
    assert tokenizer.encode("€", add_special_tokens=False) == [tokenizer.unk_token_id]


def test_tool_call_tags_are_one_token_each_after_the_characters() -> None:
    """As a real model's `<tool_call>`: the tags take ids after the 100 of the characters and
    specials (which keep theirs), decode as written, and text that spells a tag out encodes to it."""
    tokenizer = build_tokenizer()
    call = tokenizer.encode('<call>add{"a":1}</call>', add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(call[:4]) == ["<call>", "a", "d", "d"] and len(call) == 12
    assert (call[0], call[-1], len(tokenizer)) == (100, 101, 102)
    assert tokenizer.decode(call, skip_special_tokens=True) == '<call>add{"a":1}</call>'
    spelled = tokenizer.encode("<cal", add_special_tokens=False)
    assert spelled == [tokenizer.convert_tokens_to_ids(c) for c in "<cal"]


def test_export_round_trips_through_auto_classes_with_identical_logits(exported: Path) -> None:
    original = build_preset("tiny", seed=0)
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    text = "What is 17 * 3? Answer: 51"
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == original.tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, original.model(ids).logits)


def test_exported_directory_is_a_plain_llama_checkpoint(exported: Path) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (exported / "model.safetensors").is_file()
    assert (exported / "tokenizer.json").is_file()
    tokenizer_config = json.loads((exported / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"  # also known to transformers 4.x


def test_load_model_from_directory_and_with_random_init(exported: Path) -> None:
    ids = torch.tensor([[1, 5, 6, 7]])
    loaded = load_model(exported)
    fresh = load_model(exported, random_init=True, seed=0)
    other = load_model(exported, random_init=True, seed=3)
    assert not loaded.model.training
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, fresh.model(ids).logits)
        assert not torch.equal(loaded.model(ids).logits, other.model(ids).logits)


def test_load_model_by_preset_name_and_unknown_source() -> None:
    assert load_model("tiny").model.config.num_hidden_layers == PRESETS["tiny"].num_hidden_layers
    with pytest.raises(FileNotFoundError, match="neither a preset"):
        load_model("/nonexistent/model")
