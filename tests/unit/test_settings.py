"""Settings precedence: CLI flags > environment > config file > defaults; the run's settings check
each service's section against that service's settings, and name a wrong one by its path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from pipelinerl.common.errors import FieldViolation, InvalidArgument
from pipelinerl.common.settings import split_config_flag
from pipelinerl.launcher.checks import check_run, load_settings, setting_name, user_error
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import _service_settings
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


def refusal(args: list[str]) -> list[str] | None:
    """The `error:` lines `pipelinerl run <args>` would print, None if its settings load."""
    try:
        load_settings(args)
    except (ValidationError, InvalidArgument) as exc:
        return user_error(exc)
    return None


def test_a_misspelt_or_ill_typed_service_setting_is_refused_by_its_path(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  lerning_rate: 1\n")
    assert refusal(["--config", str(config)]) == ["trainer.lerning_rate: Extra inputs are not permitted"]
    config.write_text("trainer:\n  learner:\n    lr: fast\n")
    [line] = refusal(["--config", str(config)]) or []
    assert line.startswith("trainer.learner.lr: Input should be a valid number")
    [line] = refusal(["--inference", '{"max_running": 0}']) or []
    assert line.startswith("inference.max_running: Input should be greater than or equal to 1")
    assert refusal(["--coordinator.journal-path", str(tmp_path / "j.sqlite")]) is None
    assert refusal(["--config", str(tmp_path / "missing.yaml")]) == [
        f"config file not found: {tmp_path / 'missing.yaml'}"
    ]


def test_a_section_overrides_only_the_fields_it_gives(tmp_path: Path) -> None:
    settings = RunSettings(
        run_dir=tmp_path, lr=0.01, trainer={"learner": {"loss": {"kind": "ppo"}}}, reward={"workers": 3}
    )
    configs = _service_settings(settings, tmp_path, threads=1)
    # the section's field joins the launcher's own (the run's entropy_coef), deep-merged
    assert configs["trainer"]["learner"]["loss"] == {"kind": "ppo", "entropy_coef": settings.entropy_coef}
    assert configs["trainer"]["learner"]["lr"] == 0.01  # the launcher's value, from the run's `lr`
    assert configs["trainer"]["samples_per_step"] == settings.samples_per_step
    # no service default is written as if it were given; metrics_port 0 (a free port) and the log
    # level are the launcher's
    assert configs["reward"] == {"workers": 3, "metrics_port": 0, "log_level": "info"}
    assert "port" not in configs["inference"]
    # the entropy bonus's floor is written only when the run sets one
    floored = _service_settings(RunSettings(run_dir=tmp_path, entropy_floor=0.5), tmp_path, threads=1)
    assert floored["trainer"]["learner"]["loss"]["entropy_floor"] == 0.5


def test_each_server_window_holds_its_share_of_the_attempts_in_flight(tmp_path: Path) -> None:
    def window(**fields: Any) -> int:
        return _service_settings(RunSettings(run_dir=tmp_path, **fields), tmp_path, threads=1)["inference"][
            "max_running"
        ]

    assert window(max_in_flight=256) == 256
    assert window(max_in_flight=256, inference_servers=3) == 86  # rounded up: 3 × 86 >= 256
    assert window(mode="sync", samples_per_step=128, round_steps=4) == 512  # a round is one batch
    overridden = RunSettings(run_dir=tmp_path, inference={"max_running": 32})
    assert _service_settings(overridden, tmp_path, threads=1)["inference"]["max_running"] == 32


def test_what_settings_point_to_is_checked_before_a_run_starts(tmp_path: Path) -> None:
    def violations(**values: Any) -> list[FieldViolation]:
        with pytest.raises(InvalidArgument) as refused:
            check_run(RunSettings(run_dir=tmp_path / "run", **values))
        return refused.value.violations

    [missing] = violations(dataset=str(tmp_path / "missing.jsonl"))
    assert (missing.field, missing.description) == ("dataset", f"no such file: {tmp_path / 'missing.jsonl'}")
    assert [v.field for v in violations(dataset="builtin:copy:99")] == ["dataset"]
    fields = [v.field for v in violations(model="tinyy", inference={"model": str(tmp_path / "nowhere")})]
    assert fields == ["model", "inference.model"]
    check_run(RunSettings(run_dir=tmp_path / "run", model=str(tmp_path)))  # a directory is a model
    check_run(RunSettings(dataset="/remote/data.jsonl", coordinator_address="10.0.0.1:50050"))
    assert not (tmp_path / "run").exists()


def test_a_field_of_the_run_spec_is_named_by_its_setting() -> None:
    assert setting_name("spec.dataset") == "dataset"
    assert setting_name("spec.sampling.max_new_tokens") == "max_new_tokens"
    assert setting_name("spec.sampling.top_p") == "spec.sampling.top_p"  # no setting of its own


def test_reward_addresses_come_as_one_address_a_list_or_a_repeated_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--reward-address host:port` as before, or several replicas: comma-separated, the flag
    repeated, or a JSON list, from a flag, the environment or a file."""
    from pipelinerl.coordinator.config import CoordinatorSettings

    def addresses(*flags: str) -> list[str]:
        return CoordinatorSettings.load(None, list(flags)).reward_address

    assert addresses() == ["127.0.0.1:50053"]
    assert addresses("--reward-address", "reward:50053") == ["reward:50053"]
    assert addresses("--reward-address", "a:1,b:2") == ["a:1", "b:2"]
    assert addresses("--reward-address", "a:1", "--reward-address", "b:2") == ["a:1", "b:2"]
    assert addresses("--reward-address", '["a:1", "b:2"]') == ["a:1", "b:2"]
    assert addresses("--reward-address=[]", "--reward-dns", '["reward:50053"]') == []
    config = tmp_path / "coordinator.yaml"
    config.write_text("reward_address: 'c:3'\n")
    assert CoordinatorSettings.load(config).reward_address == ["c:3"]
    monkeypatch.setenv("PIPELINERL_COORDINATOR_REWARD_ADDRESS", "d:4, e:5")
    assert CoordinatorSettings.load(config).reward_address == ["d:4", "e:5"]
    assert CoordinatorSettings.load(None, ["--reward-dns", "reward:50053"]).reward_dns == ["reward:50053"]


def test_reward_servers_are_at_least_one(tmp_path: Path) -> None:
    settings = RunSettings(run_dir=tmp_path, reward_servers=3)
    assert settings.reward_servers == 3
    with pytest.raises(ValidationError):
        RunSettings(run_dir=tmp_path, reward_servers=0)


def test_a_window_smaller_than_a_step_is_refused(tmp_path: Path) -> None:
    """Pipeline mode with fewer attempts in flight than a step needs would only ever train partial
    steps, on flushes: the setting would not mean what it says."""
    with pytest.raises(ValueError, match=r"max_in_flight \(256\) must be at least samples_per_step"):
        RunSettings(run_dir=tmp_path, max_in_flight=256, samples_per_step=512)
    assert RunSettings(run_dir=tmp_path, mode="sync", max_in_flight=256, samples_per_step=512)
