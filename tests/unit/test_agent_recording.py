"""An agent's calls into samples (EpisodeTokens.add_history), on the presets' template: a call whose
history extends the last call's prompt and completion continues the sample, with the agent's
messages as context between the model's turns; a rewritten history, or a call after a turn cut by
max_tokens, starts a new sample; a call repeated after one that generated nothing continues."""

from __future__ import annotations

from pipelinerl.common.tokenizer import build_tokenizer
from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.coordinator.chat_render import ChatRenderer
from pipelinerl.coordinator.episode_tokens import EpisodeTokens
from pipelinerl.environment.types import Message, Tool, ToolCall

TOKENIZER = build_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)
ADD = Tool("add", "a+b", {"type": "object", "properties": {"a": {}, "b": {}}})


def sampled(text: str, *, end: bool = True, version: int = 3) -> TokenSequence:
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    if end:
        ids.append(TOKENIZER.eos_token_id)
    return TokenSequence(ids, [-0.25] * len(ids), [version] * len(ids))


def decoded(ids: tuple[int, ...] | list[int]) -> str:
    return str(TOKENIZER.decode(list(ids)))


def test_a_history_that_extends_the_last_call_continues_its_sample() -> None:
    history = [Message.user("347+582")]
    episode = EpisodeTokens(RENDERER, history, [ADD], max_context=512)
    turn = episode.add_turn(sampled("<call>add</call>"), FinishReason.STOP)
    (call,) = turn.message.tool_calls
    # the agent sends back the message as the API returned it, and the tool's result
    history += [turn.message, Message.tool(call, "929")]
    append = episode.add_history(history, [ADD])
    assert append.fork is None and decoded(append.context_ids) == "\nT:929\nA:"
    episode.add_turn(sampled("929", version=4), FinishReason.STOP)
    (sample,) = episode.samples()
    assert (
        decoded(sample.token_ids)
        == "<bos>F:add(a,b) a+b\nU:347+582\nA:<call>add</call><eos>\nT:929\nA:929<eos>"
    )
    model = [decoded(sample.token_ids[a:b]) for a, b in sample.model_spans]
    assert model == ["<call>add</call><eos>", "929<eos>"]  # the agent's messages are context
    assert sample.versions == (3,) * 6 + (4,) * 4 and len(sample.logprobs) == sample.model_tokens
    assert (episode.continued, episode.forks) == (1, 0)


def test_a_rewritten_history_starts_a_new_sample() -> None:
    episode = EpisodeTokens(RENDERER, [Message.user("guess 1 to 8")], max_context=512)
    first = episode.add_turn(sampled("4"), FinishReason.STOP).message
    # the agent summarizes: the first turn's text is gone from what it sends
    rewritten = [Message.user("guess 1 to 8, not 4"), first, Message.user("higher")]
    append = episode.add_history(rewritten)
    assert append.fork is not None and append.fork.where == "earlier turns"
    episode.add_turn(sampled("6"), FinishReason.STOP)
    old, new = episode.samples()
    assert decoded(old.token_ids) == "<bos>U:guess 1 to 8\nA:4<eos>"
    assert decoded(new.token_ids) == "<bos>U:guess 1 to 8, not 4\nA:4<eos>\nU:higher\nA:6<eos>"
    # the new sample's copy of the first turn was rendered, not sampled: context, no loss
    assert [decoded(new.token_ids[a:b]) for a, b in new.model_spans] == ["6<eos>"]
    assert (episode.continued, episode.forks) == (0, 1)


def test_an_edited_answer_starts_a_new_sample() -> None:
    episode = EpisodeTokens(RENDERER, [Message.user("guess 1 to 8")], max_context=512)
    episode.add_turn(sampled("4"), FinishReason.STOP)
    edited = [Message.user("guess 1 to 8"), Message.assistant("5"), Message.user("higher")]
    append = episode.add_history(edited)
    assert append.fork is not None and append.fork.where == "the model's turn"


def test_a_call_after_a_cut_turn_starts_a_new_sample() -> None:
    """A turn cut by max_tokens has no end the template would write: it is never bridged."""
    history = [Message.user("guess 1 to 8")]
    episode = EpisodeTokens(RENDERER, history, max_context=512)
    cut = episode.add_turn(sampled("12345", end=False), FinishReason.LENGTH)
    append = episode.add_history([*history, cut.message, Message.user("a number")])
    assert append.fork is not None and append.fork.where == "a cut turn"
    assert [s.model_tokens for s in episode.samples()] == [5, 0]


def test_a_call_repeated_after_a_refused_one_continues() -> None:
    """A call whose generation failed added its history and no turn; the agent's retry sends the
    same history, which continues the sample with nothing added, and a longer one appends."""
    history = [Message.user("347+582")]
    episode = EpisodeTokens(RENDERER, history, [ADD], max_context=512)
    turn = episode.add_turn(sampled('<call>add{"a":1}</call>'), FinishReason.STOP)
    history += [turn.message, Message.tool(ToolCall("call-1-0", "add", '{"a":1}'), "bad call")]
    assert episode.add_history(history, [ADD]).fork is None
    again = episode.add_history(history, [ADD])  # no turn between: the call was refused
    assert again.fork is None and again.context_ids == ()
    episode.add_turn(sampled("929"), FinishReason.STOP)
    (sample,) = episode.samples()
    assert decoded(sample.token_ids).endswith("\nT:bad call\nA:929<eos>")
    assert episode.forks == 0
