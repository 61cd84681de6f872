"""Environments that misbehave, served by the real environment server in the hostile-environment
end-to-end tests (`environment="tests/data/hostile_environments.py:Hostile"`).

`Hostile` plays guess-a-number, except where its `behaviour` says otherwise. It misbehaves in
`reset`, the one call every episode makes (a random model's turn is usually cut by
`max_new_tokens`, and a cut turn never reaches `step`), on the episodes chosen below; the server
runs `reset` and `step` under the same limits and checks, and the coordinator handles a failed
StartEpisode and a failed StepEpisode alike. `marker_dir` holds files that several episodes (and
several server processes) share:

- `hang`: the first episode of each seed sleeps far past any deadline; its replays play normally.
- `crash`: the third episode a server process starts SIGKILLs the process, once per run.
- `assistant`: every episode of `bad_seed` answers with an assistant message.
- `huge`: every episode of `bad_seed` answers with 10 MB of text.
- `slow`: every episode waits `delay_s` in `reset`, having written `started-<pid>` (so that a
  test can kill a server while it holds an episode).
- `wrong_turn`: plays normally; the server that serves it (`wrong_turn_server.py`, not the SDK's)
  answers every turn of `bad_seed` as the next one.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path
from typing import ClassVar

from pipelinerl.environment.builtin.guess_number import GuessNumber
from pipelinerl.environment.sdk import Message, Opening

TEN_MB = 10 * 1024 * 1024
HANG_S = 600.0
CRASH_AT = 3
"""The episode, counted from 1 in a server process, whose `reset` kills the process."""


class Hostile(GuessNumber):
    name = "hostile"
    description = "guess a number, or misbehave as `behaviour` says"
    started: ClassVar[itertools.count[int]] = itertools.count(1)
    """Episodes this process has started."""

    def __init__(self, behaviour: str, marker_dir: str, bad_seed: int = -1, delay_s: float = 0.0) -> None:
        super().__init__(high=8, turns=2)
        self.behaviour, self.markers = behaviour, Path(marker_dir)
        self.bad_seed, self.delay_s = bad_seed, delay_s

    def reset(self, seed: int, task: str) -> Opening:
        number = next(self.started)
        if self.behaviour == "hang" and self._first(f"hang-{seed}"):
            time.sleep(HANG_S)
        if self.behaviour == "crash" and number == CRASH_AT and self._first("crash"):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.behaviour == "assistant" and seed == self.bad_seed:
            return Opening([Message.user("guess"), Message.assistant("I answer for the model")])
        if self.behaviour == "huge" and seed == self.bad_seed:
            return Opening([Message.user("x" * TEN_MB)])
        if self.behaviour == "slow":
            (self.markers / f"started-{os.getpid()}").touch()
            time.sleep(self.delay_s)
        return super().reset(seed, task)

    def _first(self, marker: str) -> bool:
        """Whether this call is the first of the run to claim `marker`."""
        try:
            (self.markers / marker).touch(exist_ok=False)
        except FileExistsError:
            return False
        return True
