"""`pipelinerl run` with every service behind a bearer token, then behind TLS: each run trains its
budget, so every call between the services (the bidirectional Generate and SubmitSamples streams
included) carried the token or verified the certificate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.run import launch
from tests.integration.test_tls import make_certificate

pytestmark = pytest.mark.slow

BUDGET = 128
SERVICES = ("reward", "trainer", "inference-0", "coordinator")


def small_run(run_dir: Path, **security: object) -> RunSettings:
    # Two optimizer steps, so weight versions also reach the inference server.
    return RunSettings(run_dir=run_dir, max_samples=BUDGET, samples_per_step=64, duration_s=60, **security)


async def test_a_run_with_an_auth_token_trains_its_budget(tmp_path: Path) -> None:
    result = await launch(small_run(tmp_path, auth_token="s3cret"))
    assert result.state == "completed" and result.trained == BUDGET
    for service in SERVICES:
        assert yaml.safe_load((tmp_path / f"{service}.yaml").read_text())["auth_token"] == "s3cret"


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_a_run_over_tls_trains_its_budget(tmp_path: Path) -> None:
    cert, key = make_certificate(tmp_path)
    result = await launch(small_run(tmp_path / "run", tls_cert_file=cert, tls_key_file=key))
    assert result.state == "completed" and result.trained == BUDGET
    configs = {s: yaml.safe_load((tmp_path / "run" / f"{s}.yaml").read_text()) for s in SERVICES}
    assert all(config["tls_cert_file"] == str(cert) for config in configs.values())
    # The clients verify the others with the CA from their own settings, not the environment.
    assert configs["coordinator"]["services_tls_ca_file"] == str(cert)
    assert configs["inference-0"]["trainer_tls_ca_file"] == str(cert)
