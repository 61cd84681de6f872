"""The trainer's checkpoint folder: complete checkpoints behind one atomic `latest` link, and the
highest version ever published, so a restart resumes from a whole checkpoint under a new version.

    <dir>/v00000012.partial/   being written (ignored and removed on start)
    <dir>/v00000012/           complete: renamed from .partial once every file is on disk
    <dir>/latest -> v00000012  switched by one rename of a new link over the old one
    <dir>/published            the highest version ever published (written before it is)

Every step of a save leaves `latest` naming a complete checkpoint, so a crash at any point of it
resumes from the newest complete one. Folders of an older layout (a `latest` folder, or only
`latest.previous` left by a crash mid-swap) are still read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LATEST = "latest"
PUBLISHED = "published"
_PARTIAL = ".partial"


class CheckpointDir:
    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None."""
        for candidate in (self.root / LATEST, self.root / f"{LATEST}.previous"):
            if candidate.is_dir():  # follows the link
                return candidate.resolve()
        return None

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
