"""Settings precedence: CLI flags > environment > config file > defaults."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelinerl.common.settings import split_config_flag
from pipelinerl.reward.config import RewardSettings


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "reward.yaml"
    config.write_text("port: 6000\nworkers: 3\nhost: 0.0.0.0\nreward:\n  correctness_weight: 2.0\n")
    monkeypatch.setenv("PIPELINERL_REWARD_WORKERS", "5")
    monkeypatch.setenv("PIPELINERL_REWARD_REWARD__REL_TOL", "0.01")
    s = RewardSettings.load(config, ["--port", "7000"])
    assert (s.port, s.workers, s.host) == (7000, 5, "0.0.0.0")
    assert (s.reward.correctness_weight, s.reward.rel_tol) == (2.0, 0.01)
    assert RewardSettings.load().port == 50053


def test_toml_file_and_config_file_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "reward.toml"
    config.write_text("timeout_s = 2.5\n[reward]\nformat_pattern = 'ANSWER'\n")
    monkeypatch.setenv("PIPELINERL_REWARD_CONFIG_FILE", str(config))
    s = RewardSettings.load()
    assert (s.timeout_s, s.reward.format_pattern) == (2.5, "ANSWER")


def test_bad_input_is_refused_with_the_field(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        RewardSettings.load(tmp_path / "missing.yaml")
    bad = tmp_path / "reward.yaml"
    bad.write_text("workers: 0\n")
    with pytest.raises(ValidationError, match="workers"):
        RewardSettings.load(bad)
    bad.write_text("wrokers: 2\n")
    with pytest.raises(ValidationError, match="wrokers"):
        RewardSettings.load(bad)
    with pytest.raises(ValidationError, match="tls_cert_file and tls_key_file"):
        RewardSettings(tls_cert_file=tmp_path / "cert.pem")


def test_split_config_flag() -> None:
    assert split_config_flag(["--config", "a.yaml", "--port", "1"]) == (Path("a.yaml"), ["--port", "1"])
    assert split_config_flag(["--config=b.toml"]) == (Path("b.toml"), [])
    assert split_config_flag(["--workers", "2"]) == (None, ["--workers", "2"])
