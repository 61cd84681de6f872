"""deploy/compose.yaml stays true to the services: every command parses with its service's
settings, and every address it names is a service of the file listening on that port. (No Docker
engine is needed; `docker compose config` checks the syntax where one exists.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.reward.config import RewardSettings
from pipelinerl.trainer.config import TrainerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SETTINGS: dict[str, type[ServiceSettings]] = {
    "reward": RewardSettings,
    "trainer": TrainerSettings,
    "inference": InferenceSettings,
    "coordinator": CoordinatorSettings,
}


def services() -> dict[str, ServiceSettings]:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    parsed = {}
    for name, service in compose["services"].items():
        verb, kind, *flags = service["command"]
        assert verb == "serve" and kind in SETTINGS, name
        parsed[name] = SETTINGS[kind].load(None, flags)
        assert parsed[name].host == "0.0.0.0", f"{name} must listen beyond its container"
        assert service["healthcheck"]["test"][-1] == f"127.0.0.1:{parsed[name].port}", name
    return parsed


def test_every_command_parses_and_every_address_names_a_service_port() -> None:
    parsed = services()
    ports = {f"{name}:{settings.port}" for name, settings in parsed.items()}
    coordinator = parsed["coordinator"]
    assert isinstance(coordinator, CoordinatorSettings)
    named = [coordinator.reward_address, coordinator.trainer_address, *coordinator.inference_addresses]
    for name, settings in parsed.items():
        if isinstance(settings, InferenceSettings):
            named.append(settings.trainer_address)
            assert f"{name}:{settings.port}" in coordinator.inference_addresses
    assert set(named) <= ports, set(named) - ports
    trainer = parsed["trainer"]
    assert isinstance(trainer, TrainerSettings) and trainer.advertise_host == "trainer" and trainer.store_port


def test_the_image_installs_extras_that_exist() -> None:
    extras = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    wanted = dockerfile.split('".[', 1)[1].split(']"', 1)[0].split(",")
    assert set(wanted) <= set(extras)
