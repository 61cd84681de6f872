"""deploy/compose.yaml and deploy/Dockerfile stay true to the services: every command parses with its
service's settings, every address it names is a service of the file listening on that port, every
image builds a target that exists and checks the health of its service's port, and the file stays
within what Compose v1 accepts. (No Docker engine is needed; scripts/compose_test.sh runs it.)"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.environment.config import EnvironmentSettings
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.reward.config import RewardSettings
from pipelinerl.trainer.config import TrainerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SETTINGS: dict[str, type[ServiceSettings]] = {
    "reward": RewardSettings,
    "trainer": TrainerSettings,
    "inference": InferenceSettings,
    "coordinator": CoordinatorSettings,
    "environment": EnvironmentSettings,
}
TOKEN = "${PIPELINERL_AUTH_TOKEN:?"  # how every service takes the bearer token from the env file


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def services() -> dict[str, ServiceSettings]:
    parsed = {}
    for name, service in compose()["services"].items():
        verb, kind, *flags = service["command"]
        assert verb == "serve" and kind in SETTINGS, name
        parsed[name] = SETTINGS[kind].load(None, flags)
        assert parsed[name].host == "0.0.0.0", f"{name} must listen beyond its container"
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{parsed[name].port}", name
    return parsed


def dockerfile_stages() -> dict[str, str]:
    """Stage name -> its lines, from deploy/Dockerfile."""
    parts = re.split(r"^FROM \S+ AS (\S+)\n", (DEPLOY / "Dockerfile").read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def named_extras(dockerfile: str) -> set[str]:
    """The extras a Dockerfile (or one stage of it) installs: defaults of `*_EXTRAS` arguments and
    those written out for deploy/requirements.py."""
    named = re.findall(r"^ARG \w+_EXTRAS=(.*)$|requirements\.py \S+ ([\w,]+) ", dockerfile, re.MULTILINE)
    return {extra for match in named for group in match for extra in group.split(",") if extra}


def optional_dependencies() -> dict[str, list[str]]:
    """pyproject.toml's extras: name -> requirements."""
    return tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_every_command_parses_and_every_address_names_a_service_port() -> None:
    parsed = services()
    ports = {f"{name}:{settings.port}" for name, settings in parsed.items()}
    coordinator = parsed["coordinator"]
    assert isinstance(coordinator, CoordinatorSettings)
    named = [*coordinator.reward_address, coordinator.trainer_address, *coordinator.inference_addresses]
    named += coordinator.environment_addresses
    for name, settings in parsed.items():
        if isinstance(settings, InferenceSettings):
            named.append(settings.trainer_address)
            assert f"{name}:{settings.port}" in coordinator.inference_addresses
    assert set(named) <= ports, set(named) - ports
    assert len(coordinator.inference_addresses) == 2
    assert coordinator.environment_addresses and coordinator.tokenizer, "environment runs need both"
    trainer = parsed["trainer"]
    assert isinstance(trainer, TrainerSettings) and trainer.advertise_host == "trainer" and trainer.store_port


def test_every_service_takes_the_bearer_token_from_the_env_file(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, service in compose()["services"].items():
        _, kind, *flags = service["command"]
        for variable, value in service["environment"].items():
            assert value.startswith(TOKEN), (name, variable)
            monkeypatch.setenv(variable, "secret")
        settings = SETTINGS[kind].load(None, flags)
        tokens = [settings.auth_token, getattr(settings, "trainer_auth_token", "secret")]
        tokens.append(getattr(settings, "services_auth_token", "secret"))
        assert tokens == ["secret"] * 3, name


def test_the_file_is_one_compose_v1_runs() -> None:
    """No top-level `name` (v1 refuses it); start order gated on health; state in named volumes;
    only the coordinator reachable from the host, and only from this machine."""
    spec = compose()
    assert "name" not in spec and "version" not in spec
    for name, service in spec["services"].items():
        gates = service.get("depends_on", {}).values()
        assert all(gate == {"condition": "service_healthy"} for gate in gates), name
        assert ("ports" in service) == (name == "coordinator"), name
        for volume in service.get("volumes", []):
            assert volume.split(":")[0] in spec["volumes"], (name, volume)
    assert spec["services"]["coordinator"]["ports"] == ["127.0.0.1:50050:50050"]


def test_every_image_is_a_target_that_checks_its_service_port() -> None:
    stages = dockerfile_stages()
    for name, service in compose()["services"].items():
        kind = service["command"][1]
        assert service["build"]["target"] == kind, name
        healthcheck = re.search(r'^HEALTHCHECK .*"127\.0\.0\.1:(\d+)"\]$', stages[kind], re.MULTILINE)
        assert healthcheck is not None, kind
        assert int(healthcheck.group(1)) == SETTINGS[kind].model_fields["port"].default, kind
        assert f'CMD ["serve", "{kind}"' in stages[kind], kind


def test_the_images_install_extras_that_exist() -> None:
    extras = optional_dependencies()
    wanted = named_extras((DEPLOY / "Dockerfile").read_text())
    assert wanted and wanted <= set(extras), wanted - set(extras)


def test_only_the_inference_and_trainer_images_install_torch() -> None:
    """Every other image's venv starts from the bare `build` stage, and the extras it installs by
    default need no torch (the coordinator's tokenizers and chat templates run without it)."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = {stage: parent for parent, stage in re.findall(r"^FROM (\S+) AS (\S+)$", dockerfile, re.MULTILINE)}
    stages = dockerfile_stages()
    extras = optional_dependencies()
    for role in SETTINGS:
        venv = re.search(r"^COPY --from=(\S+) /opt/venv ", stages[role], re.MULTILINE)
        assert venv is not None, role
        if role in ("inference", "trainer"):
            assert venv.group(1) == "torch-venv", role
            continue
        assert base[venv.group(1)] == "build", role
        installed = [r for extra in named_extras(stages[venv.group(1)]) for r in extras[extra]]
        assert not [r for r in installed if r.startswith("torch")], (role, installed)


def test_requirements_lists_the_dependencies_and_those_of_the_extras() -> None:
    pyproject = DEPLOY.parent / "pyproject.toml"
    project = tomllib.loads(pyproject.read_text())["project"]

    def requirements(extras: str) -> list[str]:
        script = [sys.executable, str(DEPLOY / "requirements.py"), str(pyproject), extras]
        return subprocess.run(script, capture_output=True, text=True, check=True).stdout.splitlines()

    assert requirements("reward") == project["dependencies"] + project["optional-dependencies"]["reward"]
    assert requirements("") == project["dependencies"]


def test_every_service_serves_metrics_that_the_scrape_config_names() -> None:
    """Each service's /metrics port is in deploy/prometheus.yml, under the job of its role."""
    roles = {name: service["command"][1] for name, service in compose()["services"].items()}
    served: dict[str, set[str]] = {}
    for name, settings in services().items():
        assert settings.metrics_port is not None, f"{name} must serve /metrics"
        served.setdefault(roles[name], set()).add(f"{name}:{settings.metrics_port}")
    scrape = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
    jobs = {job["job_name"]: {t for c in job["static_configs"] for t in c["targets"]} for job in scrape}
    assert jobs == served
