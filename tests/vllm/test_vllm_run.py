"""`pipelinerl run --engine vllm`: a short RL run whose inference server is vLLM (started from the
vLLM virtualenv by the launcher running in the main one), every attempt trained exactly once."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401  (only whether it imports matters here)
except ImportError as exc:
    pytest.skip(
        f"needs the vLLM virtualenv (make vllm-env): import vllm failed: {exc}", allow_module_level=True
    )

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / ".venv" / "bin" / "pipelinerl"
SAMPLES = 512

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.mark.skipif(
    not LAUNCHER.exists(), reason="needs the main virtualenv (make venv) for the other services"
)
def test_short_run_with_vllm_inference(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        str(LAUNCHER), "run", "--engine", "vllm", "--vllm-python", sys.executable,
        "--max-samples", str(SAMPLES), "--duration-s", "300", "--run-dir", str(run_dir),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "completed" in done.stdout
    journal = sqlite3.connect(run_dir / "journal.sqlite")
    states = journal.execute("SELECT state, disposition, COUNT(*) FROM attempts GROUP BY 1, 2").fetchall()
    assert states == [("acked", "trained", SAMPLES)]
    assert "engine: vllm" in (run_dir / "inference-0.yaml").read_text()
    assert "vllm." in (run_dir / "inference-0.log").read_text()  # the server really ran vLLM
