"""Built-in verifiable tasks: problems generated from a seed, answers checked by the reward
service's `digits` or `digits_strict` verifier (partial credit per position over the longer of
answer and gold, 1.0 only for an exact answer).

A task is chosen by name in a run's dataset, `builtin:<task>[:<size>]`, for example
`builtin:copy:3`. Every task answers with digits, so the answer has several tokens and its length
matters; a randomly initialised model starts near 0 and learns the task with RL alone.

    task     prompt        answer         size (default)                   verifier
    copy     "4071="   ->  "4071"         digits of the string, 1-32 (2)   digits
    reverse  "4071="   ->  "1704"         same                             digits
    sort     "4071="   ->  "0147"         same                             digits
    repeat   "77777="  ->  "77777"        the largest count, 8-512 (128)   digits_strict

`repeat` is the long-tail task: a digit written `count` times, to be written again as many times,
`count` from 1 to the size with log(count) = log(size) × u^1.5 for u uniform (log-uniform, tilted
towards short answers). Completions (answer and end-of-sequence) run from 2 tokens to size + 1: at
size 128 a median of 7, a mean of 20 and a p99 of about 120 tokens, so every round of 16 groups
holds a few long generations beside many short ones (its p99 about 14 times its median), as
reasoning traces do. The length is the answer's: `digits_strict` counts every
character of the final answer, so filler costs credit, and a completion earns full credit only at
exactly the answer's length. The count is written out in unary rather than in decimal because a
tiny model learns to match the length of a run it can attend to sooner than to read a number
(measured with the `digits` verifier: reward 0.04 → 0.07 in 7k samples with a decimal count
`7x12=`, 0.04 → 0.4 in 10k with the unary prompt). From random weights the tiny preset first
reaches a mean reward of 0.7 after about 5 minutes on two cores (docs/benchmarks.md). A run on it
needs `max_new_tokens` of at least size + 1; `max_new_tokens()` below gives it and
`pipelinerl run` uses it by default.

Held-out problems: a prompt whose sha256 falls in the first eighth of the hash space is held out
(`held_out`); training never draws it, and an evaluation set `builtin:<task>[:<size>]` is made of
such prompts only. The partition is of the prompt text, so it is the same for every seed, task and
size (`copy`, `reverse` and `sort` share their prompts and hold out the same ones). An eighth, not
less, because the smallest default space is small: of the 100 prompts of `copy:2`, 11 are held out
(a sixteenth would hold out 4, too few to measure anything); of the 1,280 of `repeat:128`, 147.
Elsewhere: 2 of the 10 of `copy:1`, 148 of the 1,000 of `copy:3`, 16 of the 80 of `repeat:8`, 650
of the 5,120 of `repeat:512`.
"""

from __future__ import annotations

import hashlib
import math
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


@dataclass(frozen=True)
class Task:
    """A built-in task: how a problem is drawn from the run's random stream, and its size's range."""

    draw: Callable[[random.Random, int], tuple[str, str]]
    """(rng, size) -> (prompt, answer)."""
    sizes: range
    default_size: int
    size_means: str
    verifier: str = "digits"


def _digit_task(solve: Callable[[str], str]) -> Task:
    def draw(rng: random.Random, digits: int) -> tuple[str, str]:
        value = "".join(rng.choice("0123456789") for _ in range(digits))
        return f"{value}=", solve(value)

    return Task(draw, range(1, 33), 2, "digits", "digits")


_REPEAT_TILT = 1.5
"""Exponent on the uniform draw of `repeat`'s log count: 1 would be log-uniform (the gold lengths of a
round of 16 prompts have a p99 about 8.9 times their median at size 128, as the long-tail benchmark
measures it, just over its 8); 1.5 gives about 14."""


def _repeat(rng: random.Random, largest: int) -> tuple[str, str]:
    digit = rng.choice("0123456789")
    # log(count) = log(largest) * u ** 1.5, u uniform in [0, 1): log-uniform tilted towards short
    count = min(round(math.exp(math.log(largest) * rng.random() ** _REPEAT_TILT)), largest)
    return f"{digit * count}=", digit * count


TASKS: dict[str, Task] = {
    "copy": _digit_task(lambda digits: digits),
    "reverse": _digit_task(lambda digits: digits[::-1]),
    "sort": _digit_task(lambda digits: "".join(sorted(digits))),
    "repeat": Task(_repeat, range(8, 513), 128, "the largest count", "digits_strict"),
}


def parse_builtin(dataset: str, field: str = "spec.dataset") -> tuple[str, int]:
    """`builtin:<task>[:<size>]` -> (task, size); InvalidArgument on `field` naming what is wrong."""
    parts = dataset.split(":")
    if parts[0] != "builtin" or len(parts) not in (2, 3) or parts[1] not in TASKS:
        raise InvalidArgument.field(field, f"expected builtin:<{'|'.join(TASKS)}>[:<size>], got {dataset!r}")
    task = TASKS[parts[1]]
    if len(parts) == 2:
        return parts[1], task.default_size
    if not (parts[2].isdecimal() and int(parts[2]) in task.sizes):
        raise InvalidArgument.field(
            field,
            f"{task.size_means} of builtin:{parts[1]} must be {task.sizes.start} to "
            f"{task.sizes.stop - 1}, got {parts[2]!r}",
        )
    return parts[1], int(parts[2])


def max_new_tokens(dataset: str) -> int:
    """Tokens a completion needs for the longest answer of a built-in dataset, end-of-sequence
    included (the answer has one token per digit)."""
    return parse_builtin(dataset)[1] + 1


_HELD_OUT_ONE_IN = 8
"""One prompt in this many is held out (the module's docstring says why an eighth)."""


def held_out(text: str) -> bool:
    """Whether a prompt (or an episode seed written in decimal) is held out from training: its
    sha256 falls in the first 1/_HELD_OUT_ONE_IN of the hash space, the same for every run."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
    return digest < 2**64 // _HELD_OUT_ONE_IN


def builtin_problems(task: str, size: int, seed: int) -> Iterator[Problem]:
    """An endless, reproducible stream of problems, none of them held out."""
    rng = random.Random(seed)
    draw, verifier = TASKS[task].draw, TASKS[task].verifier
    while True:
        prompt, answer = draw(rng, size)
        if not held_out(prompt):
            yield Problem(prompt=prompt, answer=answer, verifier=verifier)


_HELD_OUT_DRAWS = 100_000
"""Draws searched for a task's held-out problems, about 0.2 s of them: every held-out prompt of
`copy:2` and `repeat:128` turns up within 50,000, 630 of the 650 of `repeat:512` within 100,000,
and a search stops once it has found its limit."""


def held_out_problems(task: str, size: int, limit: int) -> list[Problem]:
    """Up to `limit` distinct held-out problems, drawn from a generator of their own: the same
    set in the same order for every run, the order in which the task's own distribution first
    draws them.
    Fewer when the size holds fewer; InvalidArgument when it holds none."""
    rng = random.Random("held-out")  # not the run's seed: every run evaluates the same problems
    draw, verifier = TASKS[task].draw, TASKS[task].verifier
    found: dict[str, str] = {}
    for _ in range(_HELD_OUT_DRAWS):
        if len(found) == limit:
            break
        prompt, answer = draw(rng, size)
        if prompt not in found and held_out(prompt):
            found[prompt] = answer
    if not found:
        raise InvalidArgument.field("spec.evaluations", f"builtin:{task}:{size} has no held-out problems")
    return [Problem(prompt, answer, verifier) for prompt, answer in found.items()]
