"""Episodes into tokens and turns into messages, against Qwen2.5's real chat template (as text in
tests/fixtures) on a byte-level BPE tokenizer built here with Qwen's pre-tokenizer and special
tokens, and against the presets' own template on their character tokenizer."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from pipelinerl.common.model import export_preset
from pipelinerl.common.presets import CHAT_TEMPLATE
from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.coordinator.chat_render import ChatRenderer
from pipelinerl.coordinator.episode_tokens import EpisodeTokens, SegmentedTokens
from pipelinerl.coordinator.tool_calls import BareJson, TaggedJson, TaggedNameJson
from pipelinerl.environment.types import Message, Tool, ToolCall

QWEN_TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen2_5_chat_template.jinja").read_text()
# Qwen2's pre-tokenizer split (its tokenizer.json), ahead of byte-level BPE.
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
ADD = Tool(
    "add",
    "Add two integers.",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 347, "b": 582}}\n</tool_call>'


def qwen_like_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on a little text (the template's own included), with Qwen's
    `<|im_start|>`, `<|im_end|>`, `<|endoftext|>` (special) and `<tool_call>`, `</tool_call>`
    (added, not special, as in Qwen2.5)."""
    corpus = [
        QWEN_TEMPLATE,
        'The answer is 929. Let me add: {"name": "add", "arguments": {"a": 347, "b": 582}}\n\n',
        "Hello world! hmm, <think>\nI think so.\n</think>\n\nhigher lower guess\n\nHello",
    ] * 3
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    special = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = QWEN_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def qwen() -> PreTrainedTokenizerFast:
    return qwen_like_tokenizer()


def qwen_renderer(tokenizer: PreTrainedTokenizerBase, template: str | None = None) -> ChatRenderer:
    ids = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert isinstance(ids, list)
    return ChatRenderer(tokenizer, chat_template=template, end_of_turn_ids=ids)


def token_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int:
    found = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(found, int)
    return found


def text(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> str:
    decoded = tokenizer.decode(list(ids))
    assert isinstance(decoded, str)
    return decoded


def sampled(
    tokenizer: PreTrainedTokenizerBase, text: str, *, end: str | None = "<|im_end|>", version: int = 0
):
    """The tokens a model that writes `text` canonically samples, then `end` (an end-of-turn token)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if end is not None:
        ids.append(token_id(tokenizer, end))
    return TokenSequence(ids, [-0.5] * len(ids), [version] * len(ids))


def test_a_three_turn_episode_appends_exactly_what_a_full_render_gives(qwen: PreTrainedTokenizerFast) -> None:
    renderer = qwen_renderer(qwen)
    opening = [Message.system("You add numbers."), Message.user("What is 347+582?")]
    episode = EpisodeTokens(renderer, opening, [ADD], max_context=4096)
    assert episode.token_ids == renderer.render(opening, [ADD], add_generation_prompt=True)
    assert text(qwen, episode.token_ids).endswith("<|im_start|>assistant\n")
    turns = [
        (sampled(qwen, CALL, version=3), lambda m: [Message.tool(m.tool_calls[0], "929")]),
        (
            sampled(qwen, "Let me check.\n" + CALL, version=4),
            lambda m: [Message.tool(m.tool_calls[0], "929")],
        ),
        (sampled(qwen, "The answer is 929.", version=5), None),
    ]
    sampled_ids: list[int] = []
    for completion, reply in turns:
        turn = episode.add_turn(completion, FinishReason.STOP)
        assert turn.closed and not turn.truncated
        sampled_ids += completion.token_ids
        if reply is None:
            break
        before = len(episode.token_ids)
        append = episode.add_reply(reply(turn.message))
        assert append.fork is None
        full = renderer.render(episode.messages, [ADD], add_generation_prompt=True)
        assert episode.token_ids == full  # the append is the full render, id for id
        assert list(append.context_ids) == full[before:]
        assert text(qwen, append.context_ids).startswith("\n<|im_start|>user\n<tool_response>\n929")

    (sample,) = episode.samples()
    assert episode.forks == 0 and episode.turns == 3
    # the whole episode rendered at once, less the `\n` the template writes after the last `<|im_end|>`
    assert (
        list(sample.token_ids) == renderer.render(episode.messages, [ADD], add_generation_prompt=False)[:-1]
    )
    assert [sample.token_ids[i] for i, loss in enumerate(sample.loss_mask()) if loss] == sampled_ids
    assert sample.versions == (3,) * len(turns[0][0]) + (4,) * len(turns[1][0]) + (5,) * len(turns[2][0])
    assert len(sample.logprobs) == sample.model_tokens == len(sampled_ids)
    # context and model segments alternate, the prompt first; each `\n` after `<|im_end|>` is context
    kinds = [is_model for _, _, is_model in sample.segments()]
    assert kinds == [False, True, False, True, False, True]
    for start, _end, is_model in sample.segments():
        if not is_model:
            assert text(qwen, sample.token_ids[start : start + 1]) == ("<|im_start|>" if start == 0 else "\n")
    assert sample.prompt_length == len(renderer.render(opening, [ADD], add_generation_prompt=True))


def test_tool_calls_are_read_from_token_ids(qwen: PreTrainedTokenizerFast) -> None:
    renderer = qwen_renderer(qwen)
    two = CALL + '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    message = renderer.parse(sampled(qwen, "Two sums.\n" + two).token_ids, turn=2)
    assert message.content == "Two sums."
    assert message.tool_calls == (
        ToolCall("call-2-0", "add", '{"a": 347, "b": 582}'),
        ToolCall("call-2-1", "add", '{"a": 1, "b": 2}'),
    )
    # the characters of `<|im_end|>` written as text do not end the turn; the token does
    as_text = [
        i for piece in ("<|", "im", "_end", "|>") for i in qwen.encode(piece, add_special_tokens=False)
    ]
    ids = qwen.encode("a", add_special_tokens=False) + as_text + sampled(qwen, "b").token_ids
    assert qwen.convert_tokens_to_ids("<|im_end|>") not in as_text
    assert renderer.parse(ids, turn=1).content == "a<|im_end|>b"
    # nothing after the end-of-turn token belongs to the turn
    assert renderer.parse(sampled(qwen, "x").token_ids + qwen.encode("junk"), turn=1).content == "x"


def test_invalid_tool_calls_are_answered_in_band(qwen: PreTrainedTokenizerFast) -> None:
    renderer = qwen_renderer(qwen)
    broken_arguments = '<tool_call>\n{"name": "add", "arguments": {"a": 347, "b": }}\n</tool_call>'
    (call,) = renderer.parse(sampled(qwen, broken_arguments).token_ids, turn=1).tool_calls
    assert (call.name, call.arguments, call.json_arguments()) == ("add", '{"a": 347, "b": }', None)
    not_json = "<tool_call>\nadd 347 582\n</tool_call>"
    message = renderer.parse(sampled(qwen, not_json).token_ids, turn=1)
    assert (message.content, message.tool_calls) == (not_json, ())
    unclosed = '<tool_call>\n{"name": "add"'
    assert renderer.parse(sampled(qwen, unclosed).token_ids, turn=1).content == unclosed

    # unreadable text renders back as sampled: the episode goes on
    episode = EpisodeTokens(renderer, [Message.user("add")], [ADD], max_context=4096)
    episode.add_turn(sampled(qwen, not_json), FinishReason.STOP)
    assert episode.add_reply([Message.user("that is no call")]).fork is None
    # arguments that are no JSON: the template writes them as a quoted string, not as sampled
    episode.add_turn(sampled(qwen, broken_arguments), FinishReason.STOP)
    append = episode.add_reply([Message.tool(call, "bad call")])
    assert append.fork is not None and append.fork.where == "the model's turn"


def test_a_turn_stopped_without_its_end_token_is_closed_by_context(qwen: PreTrainedTokenizerFast) -> None:
    """A stop string ended the turn before `<|im_end|>`: the template's `<|im_end|>\\n` is appended as
    context (no loss), once the sample is proven a prefix of the full render."""
    renderer = qwen_renderer(qwen)
    episode = EpisodeTokens(renderer, [Message.user("What is 347+582?")], [ADD], max_context=4096)
    turn = episode.add_turn(sampled(qwen, CALL, end=None), FinishReason.STOP)
    assert not turn.closed and turn.message.tool_calls[0].name == "add"
    append = episode.add_reply([Message.tool(turn.message.tool_calls[0], "929")])
    assert append.fork is None
    assert text(qwen, append.context_ids[:2]) == "<|im_end|>\n"
    (sample,) = episode.samples()
    assert not any(sample.loss_mask()[-len(append.context_ids) :])


def test_another_end_token_than_the_templates_forks(qwen: PreTrainedTokenizerFast) -> None:
    renderer = qwen_renderer(qwen)
    episode = EpisodeTokens(renderer, [Message.user("hi")], max_context=4096)
    turn = episode.add_turn(sampled(qwen, "Hello", end="<|endoftext|>"), FinishReason.STOP)
    assert turn.closed and turn.message.content == "Hello"
    append = episode.add_reply([Message.user("again")])
    assert append.fork is not None and append.fork.where == "the model's turn"
    assert append.fork.at == len(episode.samples()[0].token_ids) - 1  # the end token itself


def test_tokens_the_tokenizer_would_merge_fork(qwen: PreTrainedTokenizerFast) -> None:
    renderer = qwen_renderer(qwen)
    # the model spelled a word byte by byte where the tokenizer has one token for it
    spelled = [i for ch in "Hello" for i in qwen.encode(ch, add_special_tokens=False)]
    assert spelled != qwen.encode("Hello", add_special_tokens=False)
    end = token_id(qwen, "<|im_end|>")
    episode = EpisodeTokens(renderer, [Message.user("hi")], max_context=4096)
    episode.add_turn(TokenSequence([*spelled, end], [0.0] * 6, [0] * 6), FinishReason.STOP)
    fork = episode.add_reply([Message.user("again")]).fork
    assert fork is not None and fork.where == "the model's turn"
    # a turn opening with a newline: the opener's `\n` and the model's merge into one token
    episode = EpisodeTokens(renderer, [Message.user("hi")], max_context=4096)
    turn = episode.add_turn(sampled(qwen, "\nHello"), FinishReason.STOP)
    fork = episode.add_reply([Message.user("again")]).fork
    assert turn.message.content == "\nHello" and fork is not None
    assert fork.at == len(renderer.render([Message.user("hi")], add_generation_prompt=True)) - 1


def test_a_template_that_strips_earlier_reasoning_forks(qwen: PreTrainedTokenizerFast) -> None:
    """As Qwen3's does: reasoning before the last user message is dropped from the render."""
    strip = (
        "{%- set ns = namespace(last_user=-1) %}"
        "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
        "{%- endif %}{%- endfor %}"
        "{%- for m in messages %}"
        "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') "
        "if m.role == 'assistant' and loop.index0 < ns.last_user else m.content %}"
        "{{- '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    renderer = qwen_renderer(qwen, strip)
    episode = EpisodeTokens(renderer, [Message.user("guess 1 to 16")], max_context=4096)
    episode.add_turn(sampled(qwen, "<think>\nI think so.\n</think>\n\n8"), FinishReason.STOP)
    append = episode.add_reply([Message.user("higher")])
    assert append.fork is not None and append.fork.where == "the model's turn"
    assert episode.forks == 1
    first, second = episode.samples()
    assert list(append.context_ids) == list(second.token_ids) == episode.token_ids
    assert not second.model_spans and "<think>" not in text(qwen, second.token_ids)
    assert first.model_spans[-1][1] == len(first.token_ids)  # the first sample ends with the turn
    # the new sample goes on by appending
    episode.add_turn(sampled(qwen, "12"), FinishReason.STOP)
    assert episode.add_reply([Message.user("lower")]).fork is None
    assert len(episode.samples()) == 2


def test_a_turn_cut_by_max_new_tokens_ends_the_episode(qwen: PreTrainedTokenizerFast) -> None:
    renderer = qwen_renderer(qwen)
    opening = [Message.user("What is 347+582?")]
    prompt = len(renderer.render(opening, add_generation_prompt=True))
    episode = EpisodeTokens(renderer, opening, max_context=prompt + 8)
    assert episode.max_new_tokens(64) == 8
    assert episode.max_new_tokens(5) == 5
    turn = episode.add_turn(sampled(qwen, "The answer is 9", end=None), FinishReason.LENGTH)
    assert turn.truncated and not turn.closed and turn.message.content == "The answer is 9"
    with pytest.raises(ValueError, match="never bridged"):
        episode.add_reply([Message.user("go on")])
    # context: what is left caps a turn; too little left is 0, and the episode ends truncated
    episode = EpisodeTokens(renderer, opening, max_context=prompt + 40)
    episode.add_turn(sampled(qwen, "Hello"), FinishReason.STOP)
    episode.add_reply([Message.user("again")])
    left = prompt + 40 - len(episode.token_ids)
    assert 0 < left < 40 and episode.max_new_tokens(64) == left
    assert episode.max_new_tokens(64, at_least=left + 1) == 0


def test_misuse_is_refused(qwen: PreTrainedTokenizerFast) -> None:
    episode = EpisodeTokens(qwen_renderer(qwen), [Message.user("hi")], max_context=4096)
    with pytest.raises(ValueError, match="without a turn"):
        episode.add_reply([Message.user("again")])
    with pytest.raises(ValueError, match="infrastructure"):
        episode.add_turn(sampled(qwen, "x"), FinishReason.ABORT)
    episode.add_turn(sampled(qwen, "x"), FinishReason.STOP)
    with pytest.raises(ValueError, match="twice"):
        episode.add_turn(sampled(qwen, "x"), FinishReason.STOP)
    with pytest.raises(ValueError, match="no assistant"):
        episode.add_reply([Message.assistant("I am the model")])


def test_the_presets_template_renders_and_parses_a_tool_episode() -> None:
    tokenizer = build_tokenizer()
    renderer = ChatRenderer(tokenizer)
    assert isinstance(renderer.tool_calls, TaggedNameJson)
    calculator = Tool("add", "a+b", ADD.parameters)
    episode = EpisodeTokens(renderer, [Message.user("347+582")], [calculator], max_context=1024)
    assert text(tokenizer, episode.token_ids) == "<bos>F:add(a,b) a+b\nU:347+582\nA:"
    # arguments are written back as sampled, spaces and all
    turn = episode.add_turn(
        sampled(tokenizer, '<call>add{"a": 347,"b":582}</call>', end="<eos>"), FinishReason.STOP
    )
    (call,) = turn.message.tool_calls
    assert (turn.message.content, call.name, call.json_arguments()) == ("", "add", {"a": 347, "b": 582})
    assert episode.add_reply([Message.tool(call, "929")]).fork is None
    turn = episode.add_turn(sampled(tokenizer, "929", end="<eos>"), FinishReason.STOP)
    assert turn.message == Message.assistant("929")
    (sample,) = episode.samples()
    assert text(tokenizer, sample.token_ids) == (
        '<bos>F:add(a,b) a+b\nU:347+582\nA:<call>add{"a": 347,"b":582}</call><eos>\nT:929\nA:929<eos>'
    )
    # a call whose arguments are no JSON is a call all the same, for the environment to answer
    bad = renderer.parse(sampled(tokenizer, '9<call>add{"a":}</call>', end="<eos>").token_ids, turn=3)
    assert bad.content == "9" and bad.tool_calls[0].arguments == '{"a":}'
    assert (
        renderer.parse(sampled(tokenizer, "<call>{}</call>", end="<eos>").token_ids, turn=3).tool_calls == ()
    )


def test_the_presets_template_survives_export(tmp_path: Path) -> None:
    directory = export_preset(tmp_path / "tiny", "tiny", seed=0)
    loaded = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    assert loaded.chat_template == CHAT_TEMPLATE
    assert loaded("12 + 3")["input_ids"] == build_tokenizer()("12 + 3")["input_ids"]


def test_syntaxes_read_the_calls_of_their_families() -> None:
    assert TaggedJson().parse('{"name": "add"}') == ('{"name": "add"}', [])
    content, calls = TaggedJson().parse('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>')
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == ("", [("add", {"a": 1})])
    # Llama 3.x: a turn that is one JSON object with "parameters"
    content, calls = BareJson().parse('{"name": "add", "parameters": {"a": 1, "b": 2}}')
    assert (content, [(c.name, c.arguments) for c in calls]) == ("", [("add", '{"a": 1, "b": 2}')])
    assert BareJson().parse("The sum is 3.") == ("The sum is 3.", [])
    assert BareJson().parse('{"answer": 3}') == ('{"answer": 3}', [])


def _random_text(rng: random.Random, alphabet: str, words: int) -> str:
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(words))


@pytest.mark.parametrize("family", ["qwen", "preset"])
def test_random_episodes_never_fork_when_the_model_writes_as_the_template_does(
    family: str, qwen: PreTrainedTokenizerFast
) -> None:
    rng = random.Random(0)
    if family == "qwen":
        tokenizer: PreTrainedTokenizerBase = qwen
        renderer, end = qwen_renderer(qwen), "<|im_end|>"
        alphabet = "abcdefghijklmnopqrstuvwxyz0123456789.,!?"

        def write(name: str, arguments: dict[str, int]) -> str:
            return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

        separator = "\n"
    else:
        tokenizer = build_tokenizer()
        renderer, end = ChatRenderer(tokenizer), "<eos>"
        alphabet = "abcdefghijklmnopqrstuvwxyz0123456789.,!?{}\"' :"

        def write(name: str, arguments: dict[str, int]) -> str:
            return f"<call>{name}{json.dumps(arguments, separators=(',', ':'))}</call>"

        separator = ""
    for _ in range(25):
        opening = [Message.user(_random_text(rng, alphabet, rng.randint(1, 5)))]
        if rng.random() < 0.5:
            opening.insert(0, Message.system(_random_text(rng, alphabet, 3)))
        tools = [ADD] if rng.random() < 0.7 else []
        episode = EpisodeTokens(renderer, opening, tools, max_context=100_000)
        for number in range(1, rng.randint(2, 6)):
            content = _random_text(rng, alphabet, rng.randint(1, 4)) if rng.random() < 0.7 else ""
            calls = [("add", {"a": rng.randint(0, 999), "b": rng.randint(0, 999)})] * (
                rng.randint(1, 2) if tools and rng.random() < 0.5 else 0
            )
            written = (content + separator if content and calls else content) + separator.join(
                write(name, arguments) for name, arguments in calls
            )
            if not written:
                written = "ok"
            turn = episode.add_turn(sampled(tokenizer, written, end=end, version=number), FinishReason.STOP)
            assert [(c.name, c.json_arguments()) for c in turn.message.tool_calls] == calls
            reply = [Message.tool(c, str(rng.randint(0, 2000))) for c in turn.message.tool_calls] or [
                Message.user(_random_text(rng, alphabet, rng.randint(1, 3)))
            ]
            assert episode.add_reply(reply).fork is None
            assert episode.token_ids == renderer.render(episode.messages, tools, add_generation_prompt=True)
        (sample,) = episode.samples()
        assert isinstance(sample, SegmentedTokens) and sample.model_tokens == len(sample.logprobs)
