"""The Gymnasium adapter (`pipelinerl.environment.adapters.gymnasium`) without a network: actions
parsed from the model's text, unparsable replies answered in-band, rewards and the end of an
episode as Gymnasium gives them, episodes that a seed reproduces, and the loader's names."""

from __future__ import annotations

import re

import pytest

from pipelinerl.environment.adapters.gymnasium import Blackjack, FrozenLake, GymnasiumText, parse_choice
from pipelinerl.environment.episodes import EpisodeTable
from pipelinerl.environment.loader import EnvironmentLoadError, load_environment
from pipelinerl.environment.sdk import Message, Step

LAKE = ("left", "down", "right", "up")
SHORTEST = ["down", "down", "right", "right", "down", "right"]  # around the holes of the 4x4 map


def say(text: str) -> Message:
    return Message.assistant(text)


def play(env: GymnasiumText, seed: int, actions: list[str], task: str = "") -> tuple[str, list[Step]]:
    """The opening's text and the steps until the episode ends or the actions run out."""
    opening = env.reset(seed, task)
    steps: list[Step] = []
    for action in actions:
        steps.append(env.step(say(action)))
        if steps[-1].ended:
            break
    env.close()
    return opening.messages[0].content, steps


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("left", 0),
        ("DOWN", 1),
        ("Right.", 2),
        ("I go up", 3),
        ("  up\n", 3),
        ("3", 3),
        ("move 0", 0),
        ("down, not up", 1),  # the first one named
        ("2 or left", 2),
    ],
)
def test_an_action_is_read_from_the_text(text: str, expected: int) -> None:
    assert parse_choice(text, LAKE) == expected


@pytest.mark.parametrize("text", ["", "north", "downhill", "upward", "4", "12", "-", "l e f t", "leftright"])
def test_a_text_that_names_no_action_is_none(text: str) -> None:
    assert parse_choice(text, LAKE) is None


def test_aliases_name_actions_too() -> None:
    assert parse_choice("I STAND", ("stick", "hit"), {"stand": 0}) == 0


def test_frozen_lake_shortest_path_reaches_the_goal() -> None:
    opening, steps = play(FrozenLake(), 0, SHORTEST)
    assert opening == "frozen lake: reach G, avoid H. say left, down, right or up.\nPFFF\nFHFH\nFFFH\nHFFG"
    assert [s.components[0].value for s in steps] == [0.0] * 5 + [1.0]
    assert steps[-1].terminated and not steps[-1].truncated
    assert steps[0].messages[0].content == "SFFF\nPHFH\nFFFH\nHFFG"
    assert steps[-1].messages[0].content == "SFFF\nFHFH\nFFFH\nHFFP\ngoal"
    assert all(not s.ended for s in steps[:-1])


def test_frozen_lake_ends_in_a_hole_with_reward_0() -> None:
    _, steps = play(FrozenLake(), 0, ["right", "down", "down"])
    assert len(steps) == 2 and steps[-1].terminated and steps[-1].reward == 0.0
    assert steps[-1].messages[0].content == "SFFF\nFPFH\nFFFH\nHFFG\nhole"


def test_an_unparsable_reply_is_an_observation_and_takes_no_step() -> None:
    env = FrozenLake()
    env.reset(0, "")
    moved = env.step(say("Down"))
    for text in ["go north", "", "4"]:
        answer = env.step(say(text))
        assert [m.content for m in answer.messages] == ["say one of: left, down, right, up"]
        assert answer.components == () and not answer.ended
    assert env.step(say("1")).messages[0].content == "SFFF\nFHFH\nPFFH\nHFFG"  # one row below `moved`
    assert moved.messages[0].content == "SFFF\nPHFH\nFFFH\nHFFG"


def test_a_slippery_lake_is_reproduced_by_its_seed() -> None:
    actions = ["right", "down"] * 10
    runs = {seed: play(FrozenLake(is_slippery=True), seed, actions) for seed in range(8)}
    for seed, run in runs.items():
        assert play(FrozenLake(is_slippery=True), seed, actions) == run
    assert len({tuple(m.content for s in steps for m in s.messages) for _, steps in runs.values()}) > 1


def test_a_random_lake_is_drawn_from_the_seed_and_a_task_names_a_lake() -> None:
    maps = {seed: FrozenLake(random_map=True).reset(seed, "").messages[0].content for seed in range(6)}
    assert all(FrozenLake(random_map=True).reset(s, "").messages[0].content == m for s, m in maps.items())
    assert len(set(maps.values())) > 1
    _, steps = play(FrozenLake(), 0, ["down", "right", "right"], task="SFH/FFG")
    assert steps[-1].terminated and steps[-1].reward == 1.0
    for bad in ["SFX/FFG", "SF/FFG", "FFF/FFG", "SFF/FFF"]:
        with pytest.raises(ValueError):
            FrozenLake().reset(0, bad)


def test_the_turn_limit_is_the_episodes() -> None:
    assert FrozenLake().reset(0, "").max_turns == 10
    assert FrozenLake(turns=4).reset(0, "").max_turns == 4
    with pytest.raises(ValueError):
        FrozenLake(map_name="5x5")


def test_gymnasium_truncation_is_the_steps() -> None:
    env = GymnasiumText(
        "FrozenLake-v1",
        render_observation=lambda observation: f"at {observation}",
        parse_action=lambda text: LAKE.index(text) if text in LAKE else None,
        is_slippery=False,
        max_episode_steps=3,
    )
    assert env.reset(0, "").messages[0].content == "at 0"
    steps = [env.step(say("left")) for _ in range(3)]
    assert [(s.terminated, s.truncated) for s in steps] == [(False, False), (False, False), (False, True)]
    assert steps[-1].messages[0].content == "at 0" and steps[-1].rewards == {"env": 0.0}
    with pytest.raises(ValueError):
        env.reset(0, "a task")


def test_the_defaults_read_a_discrete_action_number() -> None:
    env = GymnasiumText("FrozenLake-v1", is_slippery=False)
    assert env.reset(0, "").messages[0].content == "0"
    assert env.step(say("2")).messages[0].content == "1"
    assert env.step(say("right")).messages[0].content == "say an action"
    assert env.step(say("7")).messages[0].content == "say an action"


def test_blackjack_hands_follow_the_rules() -> None:
    shape = re.compile(r"sum (\d+) dealer (\d+) ace (yes|no)")
    outcomes: dict[str, float] = {}
    for seed in range(40):
        env = Blackjack()
        opening = env.reset(seed, "").messages[0].content
        head, hand = opening.split("\n")
        assert head == "blackjack: say hit or stick."
        found = shape.fullmatch(hand)
        assert found and 1 <= int(found.group(2)) <= 10
        step = env.step(say("hit" if int(found.group(1)) < 15 else "Stick"))
        while not step.ended:
            step = env.step(say("stand"))
        assert step.terminated and not step.truncated
        outcome = step.messages[0].content.split("\n")[-1]
        outcomes[outcome] = step.reward
        assert step.reward == {"win": 1.0, "lose": -1.0, "draw": 0.0}[outcome]
        assert Blackjack().reset(seed, "").messages[0].content == opening  # the same seed, the same hand
    assert {"win", "lose"} <= set(outcomes)


def test_blackjack_reads_hit_stick_and_gymnasiums_numbers() -> None:
    env = Blackjack()
    env.reset(1, "")
    answer = env.step(say("double down"))
    assert [m.content for m in answer.messages] == ["say one of: hit, stick"] and answer.components == ()
    assert parse_choice("HIT me", Blackjack.ACTIONS) == 1
    assert Blackjack().parse_action("0") == 0 and Blackjack().parse_action("1") == 1
    assert Blackjack().parse_action("stand") == 0 and Blackjack().parse_action("2") is None


def test_the_text_fits_the_tiny_presets_characters() -> None:
    from pipelinerl.common.tokenizer import CHARACTERS

    _, steps = play(FrozenLake(), 0, ["up", "nothing", *SHORTEST])
    texts = [FrozenLake().reset(0, "").messages[0].content] + [m.content for s in steps for m in s.messages]
    texts += [Blackjack().reset(seed, "").messages[0].content for seed in range(5)]
    assert set("".join(texts)) <= set(CHARACTERS)


@pytest.mark.parametrize(
    ("spec", "cls"),
    [
        ("builtin:frozen_lake", FrozenLake),
        ("builtin:blackjack", Blackjack),
        ("pipelinerl.environment.adapters.gymnasium:FrozenLake", FrozenLake),
    ],
)
def test_the_loader_finds_them(spec: str, cls: type) -> None:
    assert load_environment(spec) is cls


def test_the_loader_checks_their_arguments() -> None:
    assert load_environment("builtin:frozen_lake", {"is_slippery": True}) is FrozenLake
    with pytest.raises(EnvironmentLoadError, match="env_args"):
        load_environment("builtin:frozen_lake", {"slippery": True})


async def test_an_episode_through_the_episode_table() -> None:
    episodes = EpisodeTable(FrozenLake, {"is_slippery": False})
    opening = await episodes.start("lake", 0, "")
    assert opening.max_turns == 10 and opening.messages[0].content.endswith("HFFG")
    results = [await episodes.step("lake", turn, say(a)) for turn, a in enumerate(SHORTEST, 1)]
    assert results[-1].terminated and sum(r.reward for r in results) == 1.0
    await episodes.end("lake")
