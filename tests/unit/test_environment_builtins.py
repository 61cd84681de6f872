"""The built-in environments through the episode table: a scripted player reaches reward 1, a bad
player gets its mistakes answered in-band, and every text fits the tiny preset's characters."""

from __future__ import annotations

import json

import pytest

from pipelinerl.environment.episodes import EpisodeTable
from pipelinerl.environment.loader import load_environment
from pipelinerl.environment.types import EpisodeOpening, Message, Role, StepResult, ToolCall


def table(name: str, **env_args: object) -> EpisodeTable:
    return EpisodeTable(load_environment(f"builtin:{name}", dict(env_args)), dict(env_args))


def texts(opening: EpisodeOpening, results: list[StepResult]) -> list[str]:
    return [m.content for m in opening.messages] + [m.content for r in results for m in r.messages]


async def play_guess_number(episodes: EpisodeTable, episode_id: str, seed: int) -> list[StepResult]:
    """Binary search from the higher/lower replies."""
    opening = await episodes.start(episode_id, seed, "")
    low, high = (int(n) for n in opening.messages[0].content.removeprefix("guess ").split(" to "))
    results: list[StepResult] = []
    for turn in range(1, opening.max_turns + 1):
        guess = (low + high) // 2
        results.append(await episodes.step(episode_id, turn, Message.assistant(str(guess))))
        if results[-1].ended:
            break
        if results[-1].messages[0].content == "higher":
            low = guess + 1
        else:
            high = guess - 1
    return results


async def test_guess_number_is_solved_by_binary_search_for_every_secret() -> None:
    from pipelinerl.common.tokenizer import CHARACTERS

    episodes = table("guess_number")
    for seed in range(40):
        results = await play_guess_number(episodes, f"g{seed}", seed)
        assert results[-1].terminated and results[-1].reward == 1.0, seed
        opening = await episodes.start(f"g{seed}", seed, "")
        assert set("".join(texts(opening, results))) <= set(CHARACTERS)
        await episodes.end(f"g{seed}")
    assert len({(await episodes.start(f"s{s}", s, "")).messages[0].content for s in range(3)}) == 1


async def test_guess_number_answers_mistakes_and_truncates_at_its_last_turn() -> None:
    episodes = table("guess_number", low=1, high=3, turns=2)
    opening = await episodes.start("e", 0, "2")
    assert opening.messages[0].content == "guess 1 to 3" and opening.max_turns == 2
    first = await episodes.step("e", 1, Message.assistant("no idea"))
    assert first.messages[0].content == "a number" and not first.ended
    last = await episodes.step("e", 2, Message.assistant("3"))
    assert last.messages[0].content == "lower" and last.truncated and last.reward == 0.0
    with pytest.raises(Exception, match="no number from 1 to 3"):
        await episodes.start("f", 0, "7")


async def test_guess_number_shapes_a_lost_episode_by_the_guesses_its_replies_allowed() -> None:
    episodes = table("guess_number", low=1, high=8, turns=4, shaping=0.5)
    rewards = []
    for n, guesses in enumerate(
        [["x", "x", "x", "x"], ["6", "7", "8", "9"], ["5", "4", "2", "1"], ["2", "8", "1", "4"]]
    ):
        await episodes.start(f"e{n}", 0, "3")
        results = [
            await episodes.step(f"e{n}", turn, Message.assistant(g)) for turn, g in enumerate(guesses, 1)
        ]
        assert results[-1].truncated and {c.name for c in results[-1].rewards} == {"correct", "progress"}
        rewards.append(results[-1].reward)
    # the secret is 3: no guess; 6 only (then `lower`); all but 1 (after 2's `higher`); all but 1
    assert rewards == pytest.approx([0.0, 0.5 * 1 / 5, 0.5 * 3 / 5, 0.5 * 3 / 5])
    await episodes.start("won", 0, "7")
    await episodes.step("won", 1, Message.assistant("3"))
    assert (await episodes.step("won", 2, Message.assistant("7"))).reward == 1.0


def add(call_id: str, a: object, b: object, name: str = "add") -> ToolCall:
    return ToolCall(call_id, name, json.dumps({"a": a, "b": b}))


async def test_calculator_is_solved_with_its_tool() -> None:
    from pipelinerl.common.tokenizer import CHARACTERS

    episodes = table("calculator")
    for seed in range(20):
        episode_id = f"c{seed}"
        opening = await episodes.start(episode_id, seed, "")
        assert [t.name for t in opening.tools] == ["add"]
        a, b = (int(n) for n in opening.messages[0].content.split("+"))
        called = await episodes.step(episode_id, 1, Message.assistant("", [add("call1", a, b)]))
        [result] = called.messages
        assert (result.role, result.tool_call_id, result.content) == (Role.TOOL, "call1", str(a + b))
        answered = await episodes.step(episode_id, 2, Message.assistant(result.content))
        assert answered.terminated and answered.reward == 1.0
        assert set("".join(texts(opening, [called, answered]))) <= set(CHARACTERS)


@pytest.mark.parametrize("digits", [1, 2])
async def test_calculator_sums_have_the_numbers_digits_and_are_uniform(digits: int) -> None:
    """The sums are uniform: no sum (one digit) or first digit (two) is much more common than the
    others, so that none pays without the tool's result."""
    episodes = table("calculator", digits=digits)
    answers = []
    for seed in range(240):  # within the table's 256 episodes
        opening = await episodes.start(f"f{seed}", seed, "")
        a, b = (int(n) for n in opening.messages[0].content.split("+"))
        assert len(str(a)) == len(str(b)) == len(str(a + b)) == digits
        answers.append(str(a + b)[0])
    kinds = set(answers)
    assert len(kinds) == (7 if digits == 1 else 8)  # 2 to 8; 2 to 9
    assert max(answers.count(d) for d in kinds) < 1.6 * len(answers) / len(kinds)


async def test_calculator_answers_bad_calls_in_band_and_scores_a_wrong_answer_zero() -> None:
    episodes = table("calculator", digits=2)
    opening = await episodes.start("e", 5, "")
    assert len(opening.messages[0].content) == 5
    bad = [
        add("c1", 1, 2, name="mul"),
        ToolCall("c2", "add", "{not json"),
        add("c3", "1", 2),
        add("c4", True, 2),
    ]
    replies = await episodes.step("e", 1, Message.assistant("", bad))
    assert [(m.tool_call_id, m.content) for m in replies.messages] == [
        (c.id, "bad call") for c in bad
    ] and not replies.ended
    wrong = await episodes.step("e", 2, Message.assistant("0"))
    assert wrong.terminated and wrong.reward == 0.0


async def test_calculator_adds_the_questions_numbers_when_called_without_arguments() -> None:
    episodes = table("calculator")
    opening = await episodes.start("e", 3, "")
    a, b = (int(n) for n in opening.messages[0].content.split("+"))
    called = await episodes.step("e", 1, Message.assistant("", [ToolCall("call1", "add", "")]))
    assert [m.content for m in called.messages] == [str(a + b)] and called.reward == 0.0
    answered = await episodes.step("e", 2, Message.assistant(f"{a + b}"))
    assert answered.terminated and answered.reward == 1.0
    assert [(c.name, c.value) for c in answered.rewards] == [("correct", 1.0)]


async def test_calculator_scores_an_answer_right_only_after_the_tool_returned_the_sum() -> None:
    """With one digit the sums are 2 to 8: learnt by heart, they would pay without the tool."""
    episodes = table("calculator", digits=1, shaping=0.0)
    opening = await episodes.start("guess", 4, "")
    total = sum(int(n) for n in opening.messages[0].content.split("+"))
    assert 2 <= total <= 8
    unaided = await episodes.step("guess", 1, Message.assistant(str(total)))
    assert unaided.terminated and unaided.reward == 0.0
    await episodes.start("other", 4, "")
    elsewhere = await episodes.step("other", 1, Message.assistant("", [add("c1", 1, 1)]))
    assert [m.content for m in elsewhere.messages] == ["2"]
    assert (await episodes.step("other", 2, Message.assistant(str(total)))).reward == float(total == 2)


async def test_calculator_shapes_a_wrong_answer_by_how_far_it_got() -> None:
    """Below 1 at every stage, rising with the call's start written, then with a number written and
    the sum's start."""
    episodes = table("calculator")
    rewards = []
    for n, turns in enumerate(
        [
            ["x<ca"],
            ["<call>ad"],
            ["<call>add</cal"],
            ["<call>add</call>", "x"],
            ["<call>add</call>", "0"],  # a number, though wrong, is one step
            ["<call>add</call>", "{sum3}"],
        ]
    ):
        opening = await episodes.start(f"s{n}", 3, "")
        total = sum(int(x) for x in opening.messages[0].content.split("+"))
        results = []
        for turn, text in enumerate(turns, 1):
            message = Message.assistant(text.format(sum3=f"{str(total)[:-1]}x"))
            if text.startswith("<call>") and text.endswith("</call>"):
                message = Message.assistant("", [ToolCall(f"c{turn}", "add", "")])
            results.append(await episodes.step(f"s{n}", turn, message))
        result = results[-1]
        assert result.terminated and {c.name for c in result.rewards} == {"correct", "progress"}
        rewards.append(result.reward)
    assert rewards[0] == 0.0 and rewards == sorted(set(rewards)) and rewards[-1] < 0.5
    await episodes.start("t", 3, "")  # half a tag is no step: as much as without it
    assert (await episodes.step("t", 1, Message.assistant("<call>add"))).reward == rewards[2]
    unshaped = table("calculator", shaping=0.0)
    await unshaped.start("u", 3, "")
    assert (await unshaped.step("u", 1, Message.assistant("<call>add</ca"))).reward == 0.0
    with pytest.raises(Exception, match="shaping"):
        await table("calculator", shaping=1.0).start("v", 0, "")
