"""`builtin:guess_number`: find a secret number from higher/lower replies; it needs earlier turns.

    user: guess 1 to 16        assistant: 8
    user: higher               assistant: 12
    user: lower                assistant: 10     (right: the episode terminates, correct 1)

The secret is drawn from the episode's seed (or given as the task, digits); a reply without a number
is answered `a number`. A wrong guess at the last turn truncates the episode with correct 0. The
text is digits and a few lowercase words, so that a character-level model can read it.

With `shaping` above 0, a lost episode earns the shaping component `progress`: `shaping` times the
share of its turns whose guess the earlier replies still allowed (within the range, above every
guess answered `higher`, below every guess answered `lower`), below 1 so that a found secret (reward
exactly 1) always earns more. It rewards reading the earlier turns, the point of the game. 0 (the
default) scores `correct` alone.
"""

from __future__ import annotations

import random
import re

from pipelinerl.environment.sdk import Environment, Message, Opening, Step

NUMBER = re.compile(r"-?\d+")


class GuessNumber(Environment):
    name = "guess_number"
    version = "1"
    description = "guess a secret number from higher/lower replies"
    max_turns = 6

    def __init__(self, low: int = 1, high: int = 16, turns: int = 6, shaping: float = 0.0) -> None:
        if not low <= high:
            raise ValueError(f"low {low} is above high {high}")
        if turns < 1:
            raise ValueError("turns must be 1 or more")
        if not 0 <= shaping < 1:
            raise ValueError("shaping must be from 0 to below 1")
        self.low, self.high, self.turns, self.shaping = low, high, turns, shaping
        self.secret = low
        self.turn = 0
        self.allowed = (low, high)
        """The guesses the replies so far still allow."""
        self.consistent = 0
        """Turns whose guess was allowed."""

    async def reset(self, seed: int, task: str) -> Opening:
        if task:
            if not task.isdigit() or not self.low <= int(task) <= self.high:
                raise ValueError(f"task {task!r} is no number from {self.low} to {self.high}")
            self.secret = int(task)
        else:
            self.secret = random.Random(seed).randint(self.low, self.high)
        return Opening([Message.user(f"guess {self.low} to {self.high}")], max_turns=self.turns)

    async def step(self, action: Message) -> Step:
        self.turn += 1
        found = NUMBER.search(action.content)
        guess = int(found.group()) if found else None
        if guess == self.secret:
            return Step([], {"correct": 1.0}, terminated=True)
        reply = "a number" if guess is None else ("higher" if guess < self.secret else "lower")
        if guess is not None:
            low, high = self.allowed
            self.consistent += low <= guess <= high
            self.allowed = (max(low, guess + 1), high) if guess < self.secret else (low, min(high, guess - 1))
        if self.turn >= self.turns:
            rewards = {"correct": 0.0}
            if self.shaping:
                rewards["progress"] = self.shaping * self.consistent / (self.turns + 1)
            return Step([Message.user(reply)], rewards, truncated=True)
        return Step([Message.user(reply)])

    async def close(self) -> None:
        """Nothing to release. The methods are `async` (they never block): the server calls them in
        its event loop, not in a thread each."""
