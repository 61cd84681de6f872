"""`builtin:calculator`: add two numbers with the `add` tool, then answer; it needs a tool's result.

    user: 347+282                   assistant: <call>add</call>     (or add{"a":347,"b":282})
    tool: 629                       assistant: 629                  (right: correct 1)

The numbers are drawn from the episode's seed, `digits` long, too long to add in one's head for a
small model: the answer comes from the tool. Each is below half of 10**digits, so that the sum has
as many digits and starts with 2 to 9: with any two numbers 60 % of the sums would start with 1,
a first digit that pays without reading the tool's result. The sum is drawn first, uniformly, then
the numbers that make it: with two numbers drawn uniformly the sums are triangular (with `digits`
1, 5 is a quarter of them and 2 or 8 a sixteenth), and a policy that writes the most common sum
whatever the tool said is paid for it; it settles there before it learns to read the result.
`add` adds its arguments `a` and `b`, or, called without arguments, the question's two numbers
(the shortest call, `<call>add</call>`, five tokens of the presets, which a small model can learn
from random weights within a minute; copying six digits into JSON is the harder variant, the same
tool). A turn with tool calls is answered by one tool message per call (a call of an unknown tool,
or with arguments that are not two integers `a` and `b`, is answered `bad call`); the first turn
without a tool call is the answer, scored `correct` 1 or 0, and ends the episode. An answer is
right only once a call has returned the sum: the task is to use the tool's result, and with
`digits` 1 (sums 2 to 8, the first step of a curriculum) a model could otherwise learn the sums by
heart.

A wrong answer earns the shaping component `progress`, `shaping` times how far the episode got
(below 1, so that a right answer, reward exactly 1, always earns more): up to a half for the
longest start of the call `<call>add</call>` written in the answer's turn, counted in the tokens
of the presets (a tag, `a`, `d`, `d`, a tag: a tag's first characters count for nothing, which
would otherwise hold a model at `<`), and, once a call has returned the sum, a half plus up to a
half for an answer with a number (one step) and the digits of that number (the one scored) that
agree with the sum's from the first on (one step each; spraying digits earns nothing more than
the number written first). Without the step for a number, a wrong digit would earn no more than
no digit at all, and a model that answers with anything else never tries one. `shaping=0` scores
`correct` alone.
"""

from __future__ import annotations

import random
import re
from itertools import takewhile

from pipelinerl.environment.sdk import Environment, Message, Opening, Step, Tool, ToolCall

NUMBER = re.compile(r"-?\d+")
ADD = Tool(
    "add",
    "a+b",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": [],
    },
)
CALL = ("<call>", "a", "d", "d", "</call>")
"""The shortest call, `<call>add</call>` (`add` without arguments), in the pieces the presets'
tokenizer writes it in: each tag is one token, so half a tag is no step towards the call."""


class Calculator(Environment):
    name = "calculator"
    version = "5"
    description = "add two numbers with the add tool, then answer"
    tools = (ADD,)
    max_turns = 4

    def __init__(self, digits: int = 3, shaping: float = 0.5) -> None:
        if not 1 <= digits <= 18:
            raise ValueError("digits must be 1 to 18")
        if not 0 <= shaping < 1:
            raise ValueError("shaping must be from 0 to below 1")
        self.digits, self.shaping = digits, shaping
        self.a = self.b = 0
        self.summed = False

    async def reset(self, seed: int, task: str) -> Opening:
        rng = random.Random(seed)
        low = 10 ** (self.digits - 1)
        high = 5 * low - 1
        total = rng.randint(2 * low, 2 * high)
        self.a = rng.randint(max(low, total - high), min(high, total - low))
        self.b = total - self.a
        return Opening([Message.user(f"{self.a}+{self.b}")])

    async def step(self, action: Message) -> Step:
        if action.tool_calls:
            results = [self._run(call) for call in action.tool_calls]
            self.summed = self.summed or str(self.a + self.b) in results
            return Step([Message.tool(call, r) for call, r in zip(action.tool_calls, results, strict=True)])
        found = NUMBER.search(action.content)
        if self.summed and found is not None and int(found.group()) == self.a + self.b:
            return Step([], {"correct": 1.0}, terminated=True)
        rewards = {"correct": 0.0}
        if self.shaping:
            rewards["progress"] = self.shaping * self._progress(action.content)
        return Step([], rewards, terminated=True)

    async def close(self) -> None:
        """Nothing to release. The methods are `async` (they never block): the server calls them in
        its event loop, not in a thread each."""

    def _progress(self, text: str) -> float:
        """How far a wrong answer's episode got, from 0 to below 1."""
        if not self.summed:
            return 0.5 * _longest_start(CALL, text) / (len(CALL) + 1)
        answer, found = str(self.a + self.b), NUMBER.search(text)
        if found is None:
            return 0.5
        pairs = zip(answer, found.group(), strict=False)
        right = sum(1 for _ in takewhile(lambda pair: pair[0] == pair[1], pairs))
        return 0.5 + 0.5 * (1 + right) / (len(answer) + 2)

    def _run(self, call: ToolCall) -> str:
        if call.name != ADD.name:
            return "bad call"
        if not call.arguments.strip():
            return str(self.a + self.b)
        arguments = call.json_arguments()
        if arguments is None:
            return "bad call"
        a, b = arguments.get("a"), arguments.get("b")
        if not isinstance(a, int) or not isinstance(b, int) or isinstance(a, bool) or isinstance(b, bool):
            return "bad call"
        return str(a + b)


def _longest_start(pieces: tuple[str, ...], text: str) -> int:
    """How many of `pieces`, from the first, `text` holds in a row somewhere."""
    return next((n for n in range(len(pieces), 0, -1) if "".join(pieces[:n]) in text), 0)
