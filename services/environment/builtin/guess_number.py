"""`builtin:guess_number`: find a secret number from higher/lower replies; it needs earlier turns.

    user: guess 1 to 16        assistant: 8
    user: higher               assistant: 12
    user: lower                assistant: 10     (right: the episode terminates, correct 1)

The secret is drawn from the episode's seed (or given as the task, digits); a reply without a number
is answered `a number`. A wrong guess at the last turn truncates the episode with correct 0. The
text is digits and a few lowercase words, so that a character-level model can read it.
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

    def __init__(self, low: int = 1, high: int = 16, turns: int = 6) -> None:
        if not low <= high:
            raise ValueError(f"low {low} is above high {high}")
        if turns < 1:
            raise ValueError("turns must be 1 or more")
        self.low, self.high, self.turns = low, high, turns
        self.secret = low
        self.turn = 0

    def reset(self, seed: int, task: str) -> Opening:
        if task:
            if not task.isdigit() or not self.low <= int(task) <= self.high:
                raise ValueError(f"task {task!r} is no number from {self.low} to {self.high}")
            self.secret = int(task)
        else:
            self.secret = random.Random(seed).randint(self.low, self.high)
        return Opening([Message.user(f"guess {self.low} to {self.high}")], max_turns=self.turns)

    def step(self, action: Message) -> Step:
        self.turn += 1
        found = NUMBER.search(action.content)
        guess = int(found.group()) if found else None
        if guess == self.secret:
            return Step([], {"correct": 1.0}, terminated=True)
        reply = "a number" if guess is None else ("higher" if guess < self.secret else "lower")
        if self.turn >= self.turns:
            return Step([Message.user(reply)], {"correct": 0.0}, truncated=True)
        return Step([Message.user(reply)])
