"""A model's chat template, both ways: an episode's messages into token ids, and the token ids of a
model's turn into an assistant message with its tool calls.

    renderer = ChatRenderer(tokenizer, end_of_turn_ids=model_info.eos_token_ids)
    prompt = renderer.render(opening, tools, add_generation_prompt=True)
    message = renderer.parse(completion_ids, turn=1)

A turn is read from its token ids, not from text the engine decoded: it ends at the first
end-of-turn id the model sampled (`<|im_end|>` is one token; the same characters written as text
are not), and every token before it, special or not, is part of the message's text. The tool-call
syntax comes from the template (`tool_calls.syntax_for_template`) unless one is given.

Whether a rendering equals what the model sampled is `episode_tokens`'s to prove.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from pipelinerl.coordinator.tool_calls import ToolCallSyntax, syntax_for_template
from pipelinerl.environment.openai_shape import message_to_openai, tool_to_openai
from pipelinerl.environment.types import Message, Role, Tool, ToolCall


class ChatRenderer:
    """Renders messages with `chat_template` (default: the tokenizer's) and parses turns in its
    tool-call syntax. `end_of_turn_ids`: the ids that end a model's turn (the engine's EOS ids and
    any stop token ids of the run); the tokenizer's EOS is always one."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None = None,
        tool_calls: ToolCallSyntax | None = None,
        end_of_turn_ids: Iterable[int] = (),
    ) -> None:
        template = chat_template or tokenizer.chat_template
        if not isinstance(template, str):
            raise ValueError("the tokenizer has no chat template (or several); pass chat_template")
        self.tokenizer = tokenizer
        self.chat_template = template
        self.tool_calls = tool_calls if tool_calls is not None else syntax_for_template(template)
        eos = tokenizer.eos_token_id
        self.end_of_turn_ids = frozenset(end_of_turn_ids) | ({eos} if isinstance(eos, int) else set())
        if not self.end_of_turn_ids:
            raise ValueError("no end-of-turn token: the tokenizer has no EOS and none was given")

    def render(
        self, messages: Sequence[Message], tools: Sequence[Tool] = (), *, add_generation_prompt: bool
    ) -> list[int]:
        """The token ids of `messages` (and `tools`, in the OpenAI function shape), as the template
        writes them; with `add_generation_prompt`, the next assistant turn's opener too."""
        ids = self.tokenizer.apply_chat_template(
            [self._template_message(m) for m in messages],
            tools=[tool_to_openai(t) for t in tools] or None,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
        )
        if not isinstance(ids, list):
            raise TypeError(f"apply_chat_template returned {type(ids).__name__}, not a list of token ids")
        return [_token_id(i) for i in ids]

    def end_of_turn(self, token_ids: Sequence[int]) -> int | None:
        """The index of the first end-of-turn id in `token_ids`, or None."""
        return next((i for i, t in enumerate(token_ids) if t in self.end_of_turn_ids), None)

    def parse(self, token_ids: Sequence[int], *, turn: int) -> Message:
        """The assistant message of a turn's sampled ids: the text before its first end-of-turn id,
        with the tool calls the syntax reads in it (ids `call-<turn>-<n>`, unique in the episode)."""
        end = self.end_of_turn(token_ids)
        body = list(token_ids[:end] if end is not None else token_ids)
        content, calls = self.tool_calls.parse(self.decode(body))
        return Message.assistant(
            content, [ToolCall(f"call-{turn}-{n}", c.name, c.arguments) for n, c in enumerate(calls)]
        )

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens included, as the model sampled them."""
        text = self.tokenizer.decode(
            list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)  # one sequence decodes to one string
        return text

    def _template_message(self, message: Message) -> dict[str, Any]:
        """A message in the shape HF chat templates read (OpenAI's)."""
        out = message_to_openai(message)
        for call in out.get("tool_calls", ()):
            call["function"]["arguments"] = self.tool_calls.template_arguments(call["function"]["arguments"])
        if message.role is Role.TOOL:
            out["name"] = message.name
        return out


def _token_id(value: object) -> int:
    if not isinstance(value, int):
        raise TypeError(f"apply_chat_template returned {value!r} among the token ids")
    return value
