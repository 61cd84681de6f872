"""Gymnasium environments as text environments: the observation is rendered as a short text, the
model's reply is parsed into an action (`pip install 'pipelinerl[gymnasium]'`).

    user: frozen lake: reach G, avoid H. say left, down, right or up.
          PFFF
          FHFH
          FFFH
          HFFG
    assistant: down           user: SFFF / PHFH / ...     (the new grid, P where the agent is)
    assistant: go north       user: say one of: left, down, right, up     (no step taken)

Each episode makes its own Gymnasium environment and resets it with the episode's seed, so every
attempt of a group plays the same game. The Gymnasium reward of each step is the reward component
`env`; Gymnasium's terminated and truncated are the Step's. A reply that names no action is an
ordinary observation (the `invalid` text), with no reward and no Gymnasium step; it still uses a
turn of the episode's `max_turns`.

`FrozenLake` (`builtin:frozen_lake`) and `Blackjack` (`builtin:blackjack`) come ready. To wrap
another environment, subclass `GymnasiumText` (or pass the two functions):

    class Taxi(GymnasiumText):
        name = "taxi"
        env_id = "Taxi-v4"
        max_turns = 30

        def render_observation(self, observation):
            return f"state {observation}"

        def parse_action(self, text):
            return parse_choice(text, ["south", "north", "east", "west", "pickup", "dropoff"])
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pipelinerl.environment.sdk import Environment, Message, Opening, Step

try:
    import gymnasium as gym
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map
    from gymnasium.spaces import Discrete
except ImportError as exc:  # the loader reports it as the reason the class cannot be loaded
    raise ImportError(
        "pipelinerl.environment.adapters.gymnasium needs gymnasium: pip install 'pipelinerl[gymnasium]'"
    ) from exc

__all__ = ["Blackjack", "FrozenLake", "GymnasiumText", "parse_choice"]

WORD = re.compile(r"[a-z]+|\d+")


def parse_choice(text: str, names: Sequence[str], aliases: dict[str, int] | None = None) -> int | None:
    """The index of the first action named in `text`: a word of `names` (or of `aliases`), case
    insensitive, or the index itself as a number standing alone; None when there is none.

    parse_choice("Go DOWN.", ["left", "down", "right", "up"]) == 1
    parse_choice("3", ["left", "down", "right", "up"]) == 3
    parse_choice("downhill 7", ["left", "down", "right", "up"]) is None
    """
    words = {name.lower(): index for index, name in enumerate(names)}
    words.update({alias.lower(): index for alias, index in (aliases or {}).items()})
    for word in WORD.findall(text.lower()):
        if word in words:
            return words[word]
        if word.isdigit() and int(word) < len(names):
            return int(word)
    return None


class GymnasiumText(Environment):
    """A Gymnasium environment, `gymnasium.make(env_id, **make_kwargs)`, one per episode.

    A subclass sets `env_id` and overrides `render_observation` and `parse_action` (or they are
    passed to the constructor). The defaults: the observation as `str()`, and for a `Discrete`
    action space its action number, the first number of the reply.
    """

    name = "gymnasium"
    version = "1"
    description = "a Gymnasium environment with text observations"
    max_turns = 20

    env_id: ClassVar[str] = ""
    """What `gymnasium.make` makes, unless the constructor names another."""
    instructions: ClassVar[str] = ""
    """The opening's first line, before the first observation; empty: none."""
    invalid: ClassVar[str] = "say an action"
    """The reply to a turn that names no action."""
    reward_name: ClassVar[str] = "env"
    """The reward component that carries Gymnasium's reward."""

    def __init__(
        self,
        env_id: str = "",
        render_observation: Callable[[Any], str] | None = None,
        parse_action: Callable[[str], Any | None] | None = None,
        turns: int = 0,
        **make_kwargs: Any,
    ) -> None:
        """`turns`: the episode's turn limit (0: the class's `max_turns`); `make_kwargs` go to
        `gymnasium.make`."""
        self.gym_id = env_id or self.env_id
        if not self.gym_id:
            raise ValueError(f"{type(self).__name__} names no Gymnasium environment (env_id)")
        if turns < 0:
            raise ValueError("turns must be 0 (the class's max_turns) or more")
        self.turns = turns or self.max_turns
        self.make_kwargs = make_kwargs
        self._render = render_observation or self.render_observation
        self._parse = parse_action or self.parse_action
        self.env: gym.Env[Any, Any] | None = None

    # What a subclass overrides.

    def make(self, seed: int, task: str) -> gym.Env[Any, Any]:
        """This episode's Gymnasium environment (reset after this with `seed`). `task`, when not
        empty, names a task in the environment's terms; the default takes none."""
        if task:
            raise ValueError(f"{self.display_name()} takes no task (got {task!r})")
        return gym.make(self.gym_id, **self.make_kwargs)

    def render_observation(self, observation: Any) -> str:
        """The observation as the model reads it."""
        return str(observation)

    def parse_action(self, text: str) -> Any | None:
        """The action the model's reply names, or None when it names none."""
        space = self.env.action_space if self.env is not None else None
        if not isinstance(space, Discrete):
            raise NotImplementedError(f"{type(self).__name__} must define parse_action for {space}")
        start, n = int(space.start), int(space.n)
        for word in WORD.findall(text):
            if word.isdigit() and start <= int(word) < start + n:
                return int(word)
        return None

    def render_step(self, observation: Any, reward: float, terminated: bool, truncated: bool) -> str:
        """The reply to a step the environment took; empty: no message."""
        return self._render(observation)

    # The Environment's methods.

    def reset(self, seed: int, task: str) -> Opening:
        self.env = self.make(seed, task)
        observation, _ = self.env.reset(seed=seed)
        text = self._render(observation)
        if self.instructions:
            text = f"{self.instructions}\n{text}"
        return Opening([Message.user(text)], max_turns=self.turns)

    def step(self, action: Message) -> Step:
        if self.env is None:
            raise RuntimeError("step before reset")
        choice = self._parse(action.content)
        if choice is None:
            return Step([Message.user(self.invalid)])
        observation, reward, terminated, truncated, _ = self.env.step(choice)
        value = float(reward)
        terminated, truncated = bool(terminated), bool(truncated) and not terminated
        text = self.render_step(observation, value, terminated, truncated)
        return Step(
            [Message.user(text)] if text else [],
            {self.reward_name: value},
            terminated=terminated,
            truncated=truncated,
        )

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
            self.env = None


class FrozenLake(GymnasiumText):
    """`FrozenLake-v1` as a grid of letters: `P` the agent, `S` the start, `F` frozen, `H` a hole,
    `G` the goal. Reward `env` 1 at the goal (terminated), 0 otherwise; a hole terminates with 0.

    `is_slippery` (False): the ice moves the agent sideways two times in three. `map_name` "4x4" or
    "8x8"; `random_map` (False): a map of `size` drawn from the seed instead (`p`: the share of
    frozen tiles). A task is a map, its rows joined by `/` (`SFFF/FHFH/FFFH/HFFG`).
    """

    name = "frozen_lake"
    version = "1"
    description = "walk the frozen lake to G without falling in a hole H"
    max_turns = 10
    env_id = "FrozenLake-v1"
    instructions = "frozen lake: reach G, avoid H. say left, down, right or up."
    invalid = "say one of: left, down, right, up"
    ACTIONS: ClassVar[tuple[str, ...]] = ("left", "down", "right", "up")

    def __init__(
        self,
        is_slippery: bool = False,
        map_name: str = "4x4",
        random_map: bool = False,
        size: int = 4,
        p: float = 0.8,
        turns: int = 0,
    ) -> None:
        if map_name not in ("4x4", "8x8"):
            raise ValueError(f"map_name {map_name!r} is not 4x4 or 8x8")
        if not 2 <= size <= 16:
            raise ValueError("size must be 2 to 16")
        if not 0.0 < p <= 1.0:
            raise ValueError("p must be above 0 and at most 1")
        super().__init__(turns=turns, is_slippery=is_slippery, map_name=map_name)
        self.random_map, self.size, self.p = random_map, size, p
        self.desc: list[str] = []

    def make(self, seed: int, task: str) -> gym.Env[Any, Any]:
        kwargs = dict(self.make_kwargs)
        if task:
            kwargs["desc"] = _lake(task)
        elif self.random_map:
            kwargs["desc"] = generate_random_map(size=self.size, p=self.p, seed=seed)
        env = gym.make(self.gym_id, **kwargs)
        lake = env.unwrapped.desc  # pyright: ignore[reportAttributeAccessIssue]  # FrozenLakeEnv's own
        self.desc = [bytes(row).decode() for row in lake]
        return env

    def render_observation(self, observation: Any) -> str:
        row, column = divmod(int(observation), len(self.desc[0]))
        rows = list(self.desc)
        rows[row] = rows[row][:column] + "P" + rows[row][column + 1 :]
        return "\n".join(rows)

    def parse_action(self, text: str) -> int | None:
        return parse_choice(text, self.ACTIONS)

    def render_step(self, observation: Any, reward: float, terminated: bool, truncated: bool) -> str:
        grid = self.render_observation(observation)
        if terminated:
            return f"{grid}\n{'goal' if reward > 0 else 'hole'}"
        return grid


def _lake(task: str) -> list[str]:
    rows = task.strip().split("/")
    if (
        len({len(row) for row in rows}) != 1
        or not rows[0]
        or set("".join(rows)) - set("SFHG")
        or "".join(rows).count("S") != 1
        or "G" not in "".join(rows)
    ):
        raise ValueError(f"task {task!r} is no lake: equal rows of S, F, H, G joined by /, one S, a G")
    return rows


class Blackjack(GymnasiumText):
    """`Blackjack-v1`: `sum 14 dealer 10 ace no` (the player's sum, the dealer's card showing, 1 an
    ace, whether the player holds an ace counted as 11). Say `hit` or `stick` (`stand`, or 1 and 0,
    Gymnasium's numbers). Reward `env`: 1 a win, -1 a loss, 0 a draw (1.5 for a natural blackjack
    with `natural`); the episode terminates at a stick or a bust, with `win`, `lose` or `draw`.
    """

    name = "blackjack"
    version = "1"
    description = "play one hand of blackjack against the dealer"
    max_turns = 8
    env_id = "Blackjack-v1"
    instructions = "blackjack: say hit or stick."
    invalid = "say one of: hit, stick"
    ACTIONS: ClassVar[tuple[str, ...]] = ("stick", "hit")

    def __init__(self, natural: bool = False, sab: bool = True, turns: int = 0) -> None:
        """`natural`, `sab`: Gymnasium's (sab: Sutton and Barto's rules, as Blackjack-v1 is
        registered)."""
        super().__init__(turns=turns, natural=natural, sab=sab)

    def render_observation(self, observation: Any) -> str:
        total, dealer, ace = observation
        return f"sum {int(total)} dealer {int(dealer)} ace {'yes' if ace else 'no'}"

    def parse_action(self, text: str) -> int | None:
        return parse_choice(text, self.ACTIONS, {"stand": 0})

    def render_step(self, observation: Any, reward: float, terminated: bool, truncated: bool) -> str:
        text = self.render_observation(observation)
        if terminated:
            outcome = "win" if reward > 0 else "lose" if reward < 0 else "draw"
            return f"{text}\n{outcome}"
        return text
