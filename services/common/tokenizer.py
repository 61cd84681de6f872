"""The presets' character-level tokenizer, and the tokenizer of any model by name or directory,
without torch: the coordinator renders episodes with it, and `pipelinerl.common.model` builds the
presets on it."""

from __future__ import annotations

import string
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pipelinerl.common.presets import CHAT_TEMPLATE, PRESETS, not_a_model

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"
TOOL_TAGS = ("<call>", "</call>")
"""The tags of a tool call in the presets' template, one token each (after the characters, whose
ids stay as they were), as a real model's are (`<tool_call>` is one token of Qwen2.5's vocabulary):
a call is a tag, the tool's name, its arguments and a tag, not 13 characters of markup. Text that
spells a tag out encodes to the tag's token, so a model that writes it character by character
still calls the tool."""


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: one token per digit, letter, punctuation mark, space or newline,
    and one per tool-call tag (`TOOL_TAGS`).

    Encoding prepends `<bos>`; characters outside the vocabulary become `<unk>`. Its chat template
    is `pipelinerl.common.presets.CHAT_TEMPLATE`, in the same characters.
    """
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Oniguruma's (?m) lets "." match newlines too, so every character is its own piece.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_tokens([AddedToken(tag, normalized=False) for tag in TOOL_TAGS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    built = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    built.chat_template = CHAT_TEMPLATE
    return built


def load_tokenizer(source: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a preset, by name, or of a local HF directory."""
    if str(source) in PRESETS:
        return build_tokenizer()
    if not Path(source).is_dir():
        raise ValueError(not_a_model(source))
    return AutoTokenizer.from_pretrained(source, local_files_only=True)
