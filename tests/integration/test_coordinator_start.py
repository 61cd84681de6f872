"""StartRun through the real coordinator process: a spec the inference servers cannot serve, or
one whose dataset does not open, is refused with INVALID_ARGUMENT naming the field, and a refused
StartRun leaves its run id free for a valid spec. `pipelinerl run` prints such a refusal as one line
naming the setting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from pipelinerl.common.channel import free_port
from pipelinerl.common.errors import InvalidArgument
from pipelinerl.common.types import SamplingParams
from pipelinerl.coordinator.client import CoordinatorClient
from pipelinerl.coordinator.coordinator import spec_to_json
from pipelinerl.coordinator.journal import Journal
from pipelinerl.coordinator.types import RunSpec, RunState
from pipelinerl.launcher.processes import start_service
from tests.integration.processes import server_process

MAX_NEW_TOKENS, MAX_CONTEXT = 48, 40  # as a server whose token limit exceeds its model's context
VALID = RunSpec(
    dataset="builtin:copy:2", group_size=2, max_in_flight=4, sampling=SamplingParams(max_new_tokens=8)
)


@pytest.fixture
async def coordinator_address(tmp_path: Path) -> AsyncIterator[str]:
    limits = (str(MAX_NEW_TOKENS), str(MAX_CONTEXT))
    async with (
        server_process("fake_inference_server.py", tmp_path, *limits) as (_, port),
        # The coordinator serves once a reward replica is up; runs need no trainer to start.
        server_process("slow_reward_server.py", tmp_path, "0") as (_, reward_port),
    ):
        nowhere = f"127.0.0.1:{free_port()}"
        settings = {
            "inference_addresses": [f"127.0.0.1:{port}"],
            "reward_address": f"127.0.0.1:{reward_port}",
            "trainer_address": nowhere,
            "journal_path": str(tmp_path / "journal.sqlite"),
        }
        service = start_service("coordinator", "pipelinerl.coordinator", settings, tmp_path)
        try:
            await service.wait_healthy(60)
            yield service.address
        finally:
            service.process.kill()  # by handle; its runs wait on a trainer that is not there
            service.process.wait()


@pytest.fixture
async def coordinator(coordinator_address: str) -> AsyncIterator[CoordinatorClient]:
    async with CoordinatorClient(coordinator_address) as client:
        yield client


async def refused_field(client: CoordinatorClient, spec: RunSpec, run_id: str) -> str:
    with pytest.raises(InvalidArgument) as refused:
        await client.start_run(spec, run_id=run_id, timeout_s=30)
    return refused.value.violations[0].field


async def test_a_refused_start_leaves_its_run_id_free(coordinator: CoordinatorClient, tmp_path: Path) -> None:
    missing = replace(VALID, dataset=str(tmp_path / "missing.jsonl"))
    assert await refused_field(coordinator, missing, "r1") == "spec.dataset"
    too_long = replace(VALID, sampling=SamplingParams(max_new_tokens=MAX_NEW_TOKENS + 1))
    assert await refused_field(coordinator, too_long, "r1") == "spec.sampling.max_new_tokens"
    run = await coordinator.start_run(VALID, run_id="r1", timeout_s=30)
    assert run.state is RunState.RUNNING and run.spec == VALID


async def test_a_spec_no_service_can_serve_is_refused_naming_its_field(
    coordinator: CoordinatorClient,
) -> None:
    def tokens(n: int) -> RunSpec:
        return replace(VALID, sampling=SamplingParams(max_new_tokens=n))

    refusals = {
        "over the servers' max_new_tokens": (tokens(MAX_NEW_TOKENS + 1), "spec.sampling.max_new_tokens"),
        "no room for a prompt": (tokens(MAX_CONTEXT), "spec.sampling.max_new_tokens"),
        "no token": (tokens(0), "spec.sampling.max_new_tokens"),
        "a group over one reward call": (
            replace(VALID, group_size=4097, max_in_flight=8192),
            "spec.group_size",
        ),
        "no group": (replace(VALID, group_size=0), "spec.group_size"),
        "nothing in flight": (replace(VALID, max_in_flight=-1), "spec.max_in_flight"),
        "a negative budget": (replace(VALID, max_samples=-1), "spec.max_samples"),
    }
    fields = {why: await refused_field(coordinator, spec, "r2") for why, (spec, _) in refusals.items()}
    assert fields == {why: field for why, (_, field) in refusals.items()}
    run = await coordinator.start_run(tokens(MAX_CONTEXT - 1), run_id="r2", timeout_s=30)
    assert run.state is RunState.RUNNING


async def test_pipelinerl_run_prints_a_refusal_as_one_line_naming_the_setting(
    coordinator_address: str, tmp_path: Path
) -> None:
    pipelinerl = Path(sys.executable).parent / "pipelinerl"
    run_dir = tmp_path / "run"  # made by the launcher, removed once the run is refused

    async def refusal(*args: str) -> list[str]:
        command = [
            str(pipelinerl),
            "run",
            "--coordinator-address",
            coordinator_address,
            "--run-dir",
            str(run_dir),
        ]
        done = await asyncio.to_thread(
            subprocess.run, [*command, *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 2, done.stderr
        assert not run_dir.exists()
        return done.stderr.splitlines()

    missing = tmp_path / "missing.jsonl"  # the coordinator's to judge: the launcher checks no file
    assert await refusal("--dataset", str(missing)) == [f"error: dataset: no such file: {missing}"]
    [line] = await refusal(
        "--group-size",
        "2",
        "--max-in-flight",
        "4",
        "--samples-per-step",
        "4",
        "--max-new-tokens",
        str(MAX_NEW_TOKENS + 1),
    )
    assert line.startswith("error: max_new_tokens: ")


async def test_start_run_of_a_completed_run_returns_it_as_it_is(
    coordinator: CoordinatorClient, tmp_path: Path
) -> None:
    """A run the journal holds as completed (before a coordinator restart) starts nothing: StartRun
    answers COMPLETED at once, not RUNNING while it finds there is nothing left to do."""
    journal = Journal(tmp_path / "journal.sqlite")  # the coordinator's own, shared through SQLite
    journal.create_run("done", spec_to_json(VALID))
    journal.set_run_state("done", RunState.COMPLETED.value)
    journal.close()
    run = await coordinator.start_run(VALID, run_id="done", timeout_s=30)
    assert run.state is RunState.COMPLETED and run.progress.dispatched == 0
    again = await coordinator.start_run(VALID, run_id="done", timeout_s=30)
    assert again.state is RunState.COMPLETED
