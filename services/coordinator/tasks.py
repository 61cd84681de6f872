"""Built-in verifiable tasks: problems generated from a seed, answers checked by the reward
service's `digits` verifier (partial credit per position, 1.0 for an exact answer).

A task is chosen by name in a run's dataset, `builtin:<task>[:<digits>]`, for example
`builtin:copy:3`. Every task reads a string of digits after the prompt marker and answers with
digits, so the answer has several tokens and its length matters; a randomly initialised model
starts near 0 and learns the task with RL alone.

    copy     "4071="  -> "4071"
    reverse  "4071="  -> "1704"
    sort     "4071="  -> "0147"
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pipelinerl.common.errors import InvalidArgument


@dataclass(frozen=True)
class Problem:
    """One prompt of a dataset with what the reward service needs to check its answers."""

    prompt: str
    answer: str
    verifier: str


TASKS: dict[str, Callable[[str], str]] = {
    "copy": lambda digits: digits,
    "reverse": lambda digits: digits[::-1],
    "sort": lambda digits: "".join(sorted(digits)),
}
DEFAULT_DIGITS = 2


def parse_builtin(dataset: str) -> tuple[str, int]:
    """`builtin:<task>[:<digits>]` -> (task, digits); InvalidArgument naming what is wrong."""
    parts = dataset.split(":")
    if parts[0] != "builtin" or len(parts) not in (2, 3) or parts[1] not in TASKS:
        raise InvalidArgument.field(
            "spec.dataset", f"expected builtin:<{'|'.join(TASKS)}>[:<digits>], got {dataset!r}"
        )
    digits = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else DEFAULT_DIGITS
    if len(parts) == 3 and not (parts[2].isdigit() and 1 <= digits <= 32):
        raise InvalidArgument.field("spec.dataset", f"digits must be 1 to 32, got {parts[2]!r}")
    return parts[1], digits


def builtin_problems(task: str, digits: int, seed: int) -> Iterator[Problem]:
    """An endless, reproducible stream of problems."""
    rng = random.Random(seed)
    solve = TASKS[task]
    while True:
        value = "".join(rng.choice("0123456789") for _ in range(digits))
        yield Problem(prompt=f"{value}=", answer=solve(value), verifier="digits")
