"""The package layout: every folder of `services/` is shipped, contracts import no torch, and the
coordinator runs without torch (its image has none)."""

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


# torch made unimportable, as in the coordinator's image, which has none: every module of the
# coordinator (its entry point and what a run imports later) loads, and the tiny preset's tokenizer
# renders a chat with a tool and parses a tool call.
COORDINATOR_WITHOUT_TORCH = """
import importlib, pkgutil, sys
sys.modules["torch"] = None
import pipelinerl.cli, pipelinerl.coordinator
for module in pkgutil.walk_packages(pipelinerl.coordinator.__path__, "pipelinerl.coordinator."):
    importlib.import_module(module.name)
from pipelinerl.common.tokenizer import load_tokenizer
from pipelinerl.coordinator.chat_render import ChatRenderer
from pipelinerl.environment.types import Message, Tool
tokenizer = load_tokenizer("tiny")
renderer = ChatRenderer(tokenizer)
add = Tool("add", "a+b", {"type": "object", "properties": {"a": {}, "b": {}}})
print(renderer.decode(renderer.render([Message.user("1+2")], [add], add_generation_prompt=True)))
turn = tokenizer.encode('<call>add{"a":1,"b":2}</call>', add_special_tokens=False) + [tokenizer.eos_token_id]
(call,) = renderer.parse(turn, turn=1).tool_calls
print(call.name, call.arguments)
"""


def test_the_coordinator_loads_and_renders_chats_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", COORDINATOR_WITHOUT_TORCH], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    rendered, parsed = out.stdout.rsplit("\n", 2)[:2]
    assert rendered == "<bos>F:add(a,b) a+b\nU:1+2\nA:"
    assert parsed == 'add {"a":1,"b":2}'


def test_a_coordinator_without_the_agent_extra_says_what_to_install(tmp_path: Path) -> None:
    # FastAPI unimportable, as in the coordinator image built without the `agent` extra
    code = (
        "import sys\nsys.modules['fastapi'] = None\nfrom pipelinerl.coordinator.__main__ import main\n"
        f"main(['--agent-gateway-port', '0', '--port', '0', '--journal-path', {str(tmp_path / 'j.db')!r}])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "install pipelinerl[agent]" in out.stderr
