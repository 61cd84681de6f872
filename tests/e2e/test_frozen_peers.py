"""A peer frozen with SIGSTOP (sockets open, nothing answered) is found by its callers within the
keepalive bound docs/guarantees.md states, and its work goes elsewhere, with the supervisor kept
out of it: the trainer (the coordinator's sample stream and the inference servers' weight streams
break, and follow it again once it is thawed), then one inference server of two and one reward
replica of two at once. The run completes and every attempt is trained exactly once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from benchmarks.frozen_peers import Freezer
from pipelinerl.common.keepalive import Keepalive
from pipelinerl.launcher.config import RestartPolicy, RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.run import launch
from tests.e2e.test_failover import assert_nothing_failed

pytestmark = pytest.mark.slow

BUDGET = 8192
"""The phases start at 1,024 trained and are over by about 2,500 (the trainer stands still while
frozen; inference-1 is frozen once it is busy again): the budget outlasts them."""
BOUND_S = Keepalive().time_s + Keepalive().timeout_s + 3.0
"""The bound docs/guarantees.md states (a ping due every time_s, unacked for timeout_s), plus 3 s
for a 2-core box shared with other work, where a caller's own reaction waits for a core."""
BACK_S = 10.0
"""How soon a thawed trainer is followed again (the submitter reconnects after 1 s)."""


async def test_frozen_peers_are_detected_and_routed_around(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    settings = RunSettings(
        run_dir=run_dir,
        max_samples=BUDGET,
        inference_servers=2,
        reward_servers=2,
        duration_s=300,
        restart=RestartPolicy(unhealthy_after_s=600),  # no restart: the callers must route around it
    )
    processes: list[ServiceProcess] = []
    freezer = Freezer(run_dir, processes, hold_s=BOUND_S + 2, trainer_hold_s=BOUND_S + 1)
    running = asyncio.ensure_future(launch(settings, freezer.follow, processes))
    try:
        figures = await freezer.phases(running, start_at=1024)
        result = await running
    finally:
        freezer.thaw_all()
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)

    late = {
        f"{callee}.{name}": seconds
        for callee, values in figures.items()
        for name, seconds in values.items()
        if seconds is None or seconds > (BACK_S if name.endswith("_back_s") else BOUND_S)
    }
    assert not late, f"not within {BOUND_S}s (back within {BACK_S}s): {late}; all: {figures}"
    assert result.state == "completed", result
    assert_nothing_failed(run_dir, settings.run_id, BUDGET)
