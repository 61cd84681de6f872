"""The contracts stand alone: `clients/python-stubs/example.py`, which compiles `protos/` itself and
cannot import the `pipelinerl` package, generates a completion and drives a run to its budget on
the four real services, through the bearer token."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess, stop_all
from pipelinerl.launcher.run import start_services

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "clients" / "python-stubs" / "example.py"
TOKEN = "stubs-only"
BUDGET = 128


def example(*args: str) -> dict:
    """Run the example without site processing: grpcio, protobuf and grpcio-tools resolve from the
    environment's site-packages, but the `.pth` that installs `pipelinerl` is never read."""
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pipelinerl') is not None)"
    assert subprocess.run([sys.executable, "-S", "-c", probe], env=env).returncode == 0
    done = subprocess.run(
        [sys.executable, "-S", str(EXAMPLE), *args, "--token", TOKEN],
        env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


async def test_stubs_generated_from_the_protos_alone_generate_and_run(tmp_path: Path) -> None:
    processes: list[ServiceProcess] = []
    try:
        settings = RunSettings(run_dir=tmp_path, auth_token=TOKEN, samples_per_step=64)
        coordinator = await start_services(settings, processes)
        inference = next(p for p in processes if p.name == "inference-0")
        completion = example("generate", "--address", inference.address, "--max-new-tokens", "6")
        run = example("run", "--address", coordinator.address, "--max-samples", str(BUDGET))
    finally:
        await stop_all(processes)
    assert len(completion["token_ids"]) == len(completion["logprobs"]) == len(completion["versions"]) >= 1
    assert completion["streamed_token_ids"] == completion["token_ids"]  # every token once, in order
    assert all(lp <= 0 for lp in completion["logprobs"])
    assert run["state"] == "RUN_STATE_COMPLETED"
    assert run["trained"] + run["dropped"] >= BUDGET and run["trainer_version"] >= 1
