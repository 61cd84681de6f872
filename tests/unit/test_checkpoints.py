"""A crash at any point of a checkpoint save leaves a folder that resumes from a complete checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from pipelinerl.trainer.checkpoint import STATE_FILE, CheckpointDir, read_trainer_state
from pipelinerl.trainer.lineage import lineage_lag


def write(directory: Path, version: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / STATE_FILE).write_text(json.dumps({"version": version, "extra_state": {}}))
    return directory


def saved(root: Path, version: int) -> CheckpointDir:
    checkpoints = CheckpointDir(root)
    checkpoints.commit(write(checkpoints.stage(version), version))
    return checkpoints


def resumed_version(root: Path) -> int | None:
    checkpoints = CheckpointDir(root)
    checkpoints.clean()
    latest = checkpoints.latest()
    return None if latest is None else read_trainer_state(latest).version


def test_a_commit_makes_the_new_checkpoint_latest_and_removes_the_old(tmp_path: Path) -> None:
    saved(tmp_path, 4)
    saved(tmp_path, 8)
    assert resumed_version(tmp_path) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "v00000008"]


def test_a_crash_while_writing_or_before_the_link_switch_resumes_the_previous(tmp_path: Path) -> None:
    checkpoints = saved(tmp_path, 4)
    write(checkpoints.stage(8), 8)  # crashed while writing: only a .partial folder
    assert resumed_version(tmp_path) == 4
    assert not list(tmp_path.glob("*.partial"))
    write(tmp_path / "v00000008", 8)  # crashed after the rename, before the link switch
    (tmp_path / "latest.link").symlink_to("v00000008")
    assert resumed_version(tmp_path) == 4
    assert not (tmp_path / "latest.link").exists()
    assert saved(tmp_path, 12).latest() == (tmp_path / "v00000012").resolve()


def test_a_crash_after_the_switch_resumes_the_new_one(tmp_path: Path) -> None:
    saved(tmp_path, 4)
    write(tmp_path / "v00000008", 8)
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").symlink_to("v00000008")  # switched; v00000004 not pruned yet
    assert resumed_version(tmp_path) == 8


def test_the_older_layout_mid_swap_resumes_its_previous_checkpoint(tmp_path: Path) -> None:
    # `mv latest latest.previous; cp -r latest.previous latest.partial`: the old swap's crash window.
    write(tmp_path / "latest.previous", 4)
    shutil.copytree(tmp_path / "latest.previous", tmp_path / "latest.partial")
    assert resumed_version(tmp_path) == 4
    assert saved(tmp_path, 8).latest() == (tmp_path / "v00000008").resolve()
    assert not (tmp_path / "latest.previous").exists()


def test_an_older_layout_folder_is_replaced_by_the_link(tmp_path: Path) -> None:
    write(tmp_path / "latest", 4)
    assert resumed_version(tmp_path) == 4
    assert saved(tmp_path, 8).latest() == (tmp_path / "v00000008").resolve()
    assert (tmp_path / "latest").is_symlink()


def test_the_highest_published_version_is_kept(tmp_path: Path) -> None:
    checkpoints = CheckpointDir(tmp_path)
    assert checkpoints.published() == -1
    checkpoints.record_published(6)
    assert CheckpointDir(tmp_path).published() == 6


def test_lag_counts_steps_not_the_versions_a_crash_skipped() -> None:
    # Checkpoint at 4, versions 5-7 published and lost, 8 republished the weights of 4.
    lost = [(5, 8)]
    assert lineage_lag(4, 8, lost) == 0
    assert lineage_lag(3, 9, lost) == 2
    assert lineage_lag(6, 9, lost) == 1  # made by lost weights: as old as the resumed ones
    assert lineage_lag(9, 11, lost) == 2
    # A second crash: checkpoint at 10, 11-12 lost, 13 republished 10.
    assert lineage_lag(3, 14, [*lost, (11, 13)]) == 14 - 3 - 4 - 3
