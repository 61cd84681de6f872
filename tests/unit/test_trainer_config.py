"""The trainer's settings load without torch, so a launcher can check a run's configuration
before any model code is imported."""

from __future__ import annotations

import subprocess
import sys


def test_trainer_settings_import_no_torch() -> None:
    code = "import sys, pipelinerl.trainer.config; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
