"""The package layout: every folder of `services/` is shipped, and contracts import no torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(("pipelinerl", *p.parent.relative_to(SERVICES).parts))
        for p in SERVICES.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk == listed


@pytest.mark.parametrize(
    "service", ["common", "inference", "trainer", "reward", "coordinator", "environment"]
)
def test_importing_contracts_and_clients_does_not_import_torch(service: str) -> None:
    modules = [f"pipelinerl.{service}.v1.{service}_pb2", f"pipelinerl.{service}.v1.{service}_pb2_grpc"]
    if service != "common":
        modules += [f"pipelinerl.{service}.client", f"pipelinerl.{service}.server"]
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
