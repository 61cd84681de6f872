"""The chaos soak's short form (benchmarks/chaos.py --short): services SIGKILLed and frozen every few
seconds while their connections are delayed, stalled, reset and dropped; the run still completes,
every attempt final and each trained one in the final weights exactly once, and nothing of it is
left running or listening. About two and a half minutes on two cores; the fault times are the
seed's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.chaos import main

pytestmark = pytest.mark.slow

BUDGET = 32768
PROCESS_FAULTS = {"kill", "freeze"}


def test_a_short_chaos_soak_completes_with_every_sample_trained_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = f"--short --seed 0 --samples {BUDGET} --limit-s 300 --out {tmp_path / 'soak'}".split()
    code = main(argv)
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, figures
    assert figures["state"] == "completed", figures
    assert figures["trained_exactly_once"], figures
    assert figures["trained"] == figures["dispositions"]["trained"], figures  # the run counted right
    assert set(figures["dispositions"]) <= {"trained", "dropped"}, figures
    assert figures["dispositions"]["trained"] >= BUDGET * 0.8, figures
    assert figures["leaked_processes"] == [] and figures["leaked_ports"] == [], figures
    faults = figures["faults"]
    assert sum(n for kind, n in faults.items() if kind in PROCESS_FAULTS) >= 2, faults
    assert sum(n for kind, n in faults.items() if kind not in PROCESS_FAULTS) >= 2, faults
    assert sum(figures["restarts"].values()) >= 1, figures
