"""`builtin:calculator`: add two numbers with the `add` tool, then answer; it needs a tool's result.

    user: 347+582                   assistant: (calls add {"a": 347, "b": 582})
    tool: 929                       assistant: 929     (right: correct 1)

The numbers are drawn from the episode's seed, `digits` long, too long to add in one's head for a
small model: the answer comes from the tool. A turn with tool calls is answered by one tool message
per call (a call of an unknown tool, or with arguments that are not two integers `a` and `b`, is
answered `bad call`); the first turn without a tool call is the answer, scored `correct` 1 or 0,
and ends the episode.
"""

from __future__ import annotations

import random
import re

from pipelinerl.environment.sdk import Environment, Message, Opening, Step, Tool, ToolCall

NUMBER = re.compile(r"-?\d+")
ADD = Tool(
    "add",
    "a+b",
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
)


class Calculator(Environment):
    name = "calculator"
    version = "1"
    description = "add two numbers with the add tool, then answer"
    tools = (ADD,)
    max_turns = 4

    def __init__(self, digits: int = 3) -> None:
        if not 1 <= digits <= 18:
            raise ValueError("digits must be 1 to 18")
        self.digits = digits
        self.a = self.b = 0

    def reset(self, seed: int, task: str) -> Opening:
        rng = random.Random(seed)
        low, high = 10 ** (self.digits - 1), 10**self.digits - 1
        self.a, self.b = rng.randint(low, high), rng.randint(low, high)
        return Opening([Message.user(f"{self.a}+{self.b}")])

    def step(self, action: Message) -> Step:
        if action.tool_calls:
            return Step([Message.tool(call, self._run(call)) for call in action.tool_calls])
        found = NUMBER.search(action.content)
        correct = found is not None and int(found.group()) == self.a + self.b
        return Step([], {"correct": float(correct)}, terminated=True)

    @staticmethod
    def _run(call: ToolCall) -> str:
        arguments = call.json_arguments()
        if call.name != ADD.name or arguments is None:
            return "bad call"
        a, b = arguments.get("a"), arguments.get("b")
        if not isinstance(a, int) or not isinstance(b, int) or isinstance(a, bool) or isinstance(b, bool):
            return "bad call"
        return str(a + b)
