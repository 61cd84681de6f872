"""Start helper servers as subprocesses that announce their port in a file; stop them by handle."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def port_file_of(script: str, tmp_path: Path) -> Path:
    return tmp_path / f"{script}.port"


@contextlib.asynccontextmanager
async def server_process(
    script: str, tmp_path: Path, *args: str, start_timeout_s: float = 60
) -> AsyncIterator[tuple[subprocess.Popen[bytes], int]]:
    """Run `tests/integration/<script> PORT_FILE *args`; yields (process, port); kills it on exit."""
    port_file = port_file_of(script, tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "integration" / script), str(port_file), *args], env=env
    )
    try:
        for _ in range(int(start_timeout_s * 20)):
            if port_file.exists() and port_file.read_text():
                break
            if proc.poll() is not None:
                raise RuntimeError(f"{script} exited with {proc.returncode} before announcing its port")
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError(f"{script} did not announce its port within {start_timeout_s}s")
        yield proc, int(port_file.read_text())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def start_trainer(command: list[str], address: str, timeout_s: float = 120) -> subprocess.Popen[bytes]:
    """Run a trainer command (python -m pipelinerl.trainer ..., or under torchrun) until it answers
    GetStatus at `address`."""
    from pipelinerl.trainer.client import TrainerClient

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(int(timeout_s * 10)):
        if proc.poll() is not None:
            raise RuntimeError(f"trainer exited: {proc.stderr.read().decode()[-3000:]}")  # type: ignore[union-attr]
        try:
            async with TrainerClient(address) as client:
                await client.status()
            return proc
        except Exception:
            await asyncio.sleep(0.1)
    proc.kill()
    proc.wait()
    raise TimeoutError(f"the trainer did not answer at {address} within {timeout_s}s")
