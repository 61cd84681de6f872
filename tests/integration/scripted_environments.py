"""Environments the integration tests serve (`--env tests.integration.scripted_environments:Scripted`):
the episode's task says how its steps behave."""

from __future__ import annotations

import time

from pipelinerl.environment.sdk import Environment, Message, Opening, Step, Tool

TEN_MB = 10 * 1024 * 1024


class Scripted(Environment):
    """Task "": each turn is answered `ok <turn>`; turn 3 terminates with reward 1. Other tasks:
    `raise`, `assistant` (answers as the model), `huge` (10 MB), `hang` (sleeps 600 s), `slow`
    (answers after `delay_s`)."""

    name = "scripted"
    version = "1"
    description = "answers ok, or misbehaves as its task says"
    tools = (Tool("noop", "does nothing", {"type": "object", "properties": {}}),)
    max_turns = 5

    def __init__(self, delay_s: float = 1.0) -> None:
        self.delay_s = delay_s
        self.turn = 0

    def reset(self, seed: int, task: str) -> Opening:
        self.task = task
        return Opening([Message.system("be brief"), Message.user(f"seed {seed}")])

    def step(self, action: Message) -> Step:
        self.turn += 1
        if self.task == "raise":
            raise RuntimeError("the sandbox is gone")
        if self.task == "assistant":
            return Step([Message.assistant("I answer for the model")])
        if self.task == "huge":
            return Step([Message.user("x" * TEN_MB)])
        if self.task == "hang":
            time.sleep(600)
        if self.task == "slow":
            time.sleep(self.delay_s)
        done = self.turn == 3
        return Step([Message.user(f"ok {self.turn}")], {"done": float(done)}, terminated=done)
