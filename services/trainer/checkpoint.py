"""Checkpoints of the trainer: what one holds, how both learners write and read it, and the folder
that keeps the latest complete one behind an atomic link, so a restart resumes from a whole checkpoint
under a new version.

    <dir>/v00000012.partial/   being written (ignored and removed on start)
    <dir>/v00000012/           complete: renamed from .partial once every file is on disk
    <dir>/latest -> v00000012  switched by one rename of a new link over the old one
    <dir>/published            the highest version ever published (written before it is)

A checkpoint holds the model as HF safetensors (with its tokenizer), the optimizer state
(`optimizer.pt`, or DeepSpeed's partitions), and `trainer_state.json`: the version and the trainer's
extra state, i.e. the sample ids trained on and the versions lost to crashes.

Every step of a save leaves `latest` naming a complete checkpoint, so a crash at any point of it
resumes from the newest complete one. Folders of an older layout (a `latest` folder, or only
`latest.previous` left by a crash mid-swap) are still read.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from pipelinerl.trainer.learner import Learner

LATEST = "latest"
PUBLISHED = "published"
STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
_PARTIAL = ".partial"


@dataclass(frozen=True)
class TrainerState:
    """The small part of a checkpoint that is not tensors."""

    version: int
    extra_state: dict[str, Any] = field(default_factory=dict)


def read_trainer_state(directory: str | Path) -> TrainerState:
    """Version and extra state of the checkpoint in `directory`; FileNotFoundError if there is none."""
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no checkpoint ({STATE_FILE} is missing)")
    state = json.loads(path.read_text())
    return TrainerState(version=int(state["version"]), extra_state=state.get("extra_state", {}))


def write_trainer_state(directory: Path, version: int, extra_state: Mapping[str, Any] | None) -> None:
    state = {"version": version, "extra_state": dict(extra_state or {})}
    (directory / STATE_FILE).write_text(json.dumps(state, indent=2))


def save_weights(
    model: PreTrainedModel, directory: Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """The model as HF safetensors; `state_dict` in place of the model's own (gathered ZeRO-3 shards)."""
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)


def load_weights(model: PreTrainedModel, directory: Path, device: torch.device) -> None:
    """Load every safetensors shard; tied parameters (saved once by save_pretrained) are the only
    names allowed to be missing."""
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(shard, device=str(device)))
    result = model.load_state_dict(state, strict=False)
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - {
        name for name, _ in model.named_parameters()
    }
    missing = set(result.missing_keys) - aliases
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint in {directory} does not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )


def save_optimizer(optimizer: torch.optim.Optimizer, directory: Path) -> None:
    torch.save(optimizer.state_dict(), directory / OPTIMIZER_FILE)


def load_optimizer(optimizer: torch.optim.Optimizer, directory: Path, device: torch.device) -> None:
    optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, map_location=device, weights_only=True))


@dataclass
class Resumed:
    """Where a restarted trainer stands."""

    version: int
    """The version to publish first: the checkpoint's, or newer than any published before the crash."""
    checkpointed: int
    """The version of the checkpoint loaded (0 without one)."""
    checkpoint: Path | None
    trained_ids: dict[str, int]
    """Sample id -> the version its step produced, for every sample the checkpoint holds."""
    lost: list[tuple[int, int]]
    """(first lost, resumed) per restart, see lineage.py."""
    published: int
    """The highest version published before (-1 for none)."""


class CheckpointDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        return latest_checkpoint(self.root)

    def stage(self, version: int) -> Path:
        """An empty folder to write the checkpoint of `version` into; `commit` makes it the latest."""
        staging = self.root / f"{_name(version)}{_PARTIAL}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        return staging

    def commit(self, staging: Path) -> Path:
        """Make the written `staging` folder the latest checkpoint, then remove older ones."""
        final = staging.with_name(staging.name.removesuffix(_PARTIAL))
        _sync_tree(staging)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        link = self.root / f"{LATEST}.link"
        link.unlink(missing_ok=True)
        link.symlink_to(final.name)
        legacy = self.root / LATEST
        if legacy.is_dir() and not legacy.is_symlink():  # an older layout's folder: keep it aside
            shutil.rmtree(self.root / f"{LATEST}.previous", ignore_errors=True)
            legacy.rename(self.root / f"{LATEST}.previous")
        os.replace(link, legacy)
        _sync_dir(self.root)
        self._prune(keep=final)
        return final

    def resume(self, learner: Learner) -> Resumed:
        """Load the latest checkpoint, if any, into `learner`. Versions published after it died with
        the crash, and receivers may hold them, so the resumed weights take a version newer than
        any of them."""
        self.clean()
        latest = self.latest()
        version, trained_ids, lost = 0, {}, []
        if latest is not None:
            version = learner.load_checkpoint(latest)
            extra = read_trainer_state(latest).extra_state
            trained_ids = dict(extra.get("trained", {}))
            lost = [(a, b) for a, b in extra.get("lost_versions", [])]
        checkpointed = version
        if (published := self.published()) > version:
            lost.append((version + 1, published + 1))
            version = published + 1
        return Resumed(version, checkpointed, latest, trained_ids, lost, published)

    def save(
        self, learner: Learner, version: int, trained_ids: Mapping[str, int], lost: list[tuple[int, int]]
    ) -> Path:
        """Write the learner's checkpoint of `version`, with the trainer's state, and make it the latest."""
        staging = self.stage(version)
        learner.save_checkpoint(staging, version, {"trained": trained_ids, "lost_versions": lost})
        return self.commit(staging)

    def clean(self) -> None:
        """Remove what a crash mid-save left behind."""
        for path in self.root.glob(f"*{_PARTIAL}"):
            shutil.rmtree(path, ignore_errors=True)
        (self.root / f"{LATEST}.link").unlink(missing_ok=True)

    def published(self) -> int:
        """The highest version ever published from this folder (-1 for none)."""
        path = self.root / PUBLISHED
        return int(path.read_text()) if path.is_file() else -1

    def record_published(self, version: int) -> None:
        """Durably note that `version` is about to be published."""
        _write_atomic(self.root / PUBLISHED, str(version))

    def _prune(self, keep: Path) -> None:
        for path in self.root.glob("v*"):
            if path.is_dir() and path != keep and not path.name.endswith(_PARTIAL):
                shutil.rmtree(path, ignore_errors=True)
        if (self.root / LATEST).is_symlink():
            shutil.rmtree(self.root / f"{LATEST}.previous", ignore_errors=True)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint in the folder `root`, or None; reads, never writes (a
    checkpoint is an HF model directory: `pipelinerl eval` evaluates it as one)."""
    for candidate in (root / LATEST, root / f"{LATEST}.previous"):
        if candidate.is_dir():  # follows the link
            return candidate.resolve()
    return None


def _name(version: int) -> str:
    return f"v{version:08d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_dir(path.parent)


def _sync_tree(root: Path) -> None:
    """fsync every file and folder under `root`, so a rename never publishes unwritten data."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(folder))


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
