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
