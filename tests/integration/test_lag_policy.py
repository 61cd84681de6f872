"""The trainer's lag policies through the service: a sample with stale tokens is dropped, trained
with its importance weight truncated, or makes the trainer wait for fresh data."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipelinerl.trainer.__main__ import build
from pipelinerl.trainer.checkpoint import CheckpointDir
from pipelinerl.trainer.client import TrainerClient
from pipelinerl.trainer.config import LagPolicy, LearnerConfig, LossConfig, TrainerSettings
from pipelinerl.trainer.types import Disposition
from tests.integration.test_trainer_loop import Stream, batches, episode_group, final, group

pytestmark = pytest.mark.slow


def settings(tmp_path: Path, policy: LagPolicy, max_lag: int) -> TrainerSettings:
    return TrainerSettings(
        port=0, run_id="lag", samples_per_step=2, max_lag=max_lag, lag_policy=policy,
        metrics_file=tmp_path / "metrics.jsonl", learner=LearnerConfig(lr=1e-3), broadcast_backend="none",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("policy", "disposition"), [("drop", Disposition.DROPPED), ("reweight", Disposition.TRAINED)]
)
async def test_stale_sample_is_dropped_or_reweighted(
    tmp_path: Path, policy: str, disposition: Disposition
) -> None:
    server = await build(settings(tmp_path, LagPolicy(policy), max_lag=0))
    await server.start()
    try:
        async with TrainerClient(server.address) as client:
            acks = [a async for a in client.submit(batches(group("a", 0, [0, 1])))]
            assert final(acks) == dict.fromkeys(["a-0", "a-1"], Disposition.TRAINED)
            # Version 1 now: version-0 tokens are one version over max_lag 0.
            acks = [a async for a in client.submit(batches(group("stale", 0, [0, 1])))]
            assert final(acks) == dict.fromkeys(["stale-0", "stale-1"], disposition)
            status = await client.status()
            assert status.dropped_samples == (2 if disposition is Disposition.DROPPED else 0)
            assert status.version.version == (1 if disposition is Disposition.DROPPED else 2)
    finally:
        await server.stop(grace=1)


async def test_wait_holds_the_next_step_until_generation_catches_up(tmp_path: Path) -> None:
    server = await build(settings(tmp_path, LagPolicy.WAIT, max_lag=1))
    await server.start()
    try:
        async with TrainerClient(server.address) as client:
            stream = Stream(client)
            await stream.send(group("a", 0, [0, 1]))
            assert await stream.trained("a-0", "a-1") == {1}
            # At version 1, stepping to 2 needs tokens of version >= 2 - max_lag = 1; these are version 0.
            await stream.send(group("old", 0, [0, 1]))
            await asyncio.sleep(1.5)
            held = {a.sample_id: a.disposition for a in stream.acks if a.sample_id.startswith("old")}
            assert held == dict.fromkeys(["old-0", "old-1"], Disposition.ACCEPTED)
            assert (await client.status()).version.version == 1
            # A version-1 sample shows the inference side caught up: the held group trains, kept (not
            # dropped) although it is stale by then; the fresh group now waits for version-2 tokens.
            await stream.send(group("fresh", 1, [0, 1]))
            assert await stream.trained("old-0", "old-1") == {2}
            await asyncio.sleep(1.5)
            assert (await client.status()).version.version == 2
            await stream.send(group("newer", 2, [0, 1]))
            assert await stream.trained("fresh-0", "fresh-1") == {3}
            await stream.close()
    finally:
        await server.stop(grace=1)


async def test_an_episodes_lag_is_that_of_its_oldest_model_token(tmp_path: Path) -> None:
    server = await build(settings(tmp_path, LagPolicy.DROP, max_lag=1))
    await server.start()
    try:
        async with TrainerClient(server.address) as client:
            for name, version in (("a", 0), ("b", 1)):
                acks = [a async for a in client.submit(batches(group(name, version, [0, 1])))]
                assert set(final(acks).values()) == {Disposition.TRAINED}
            # Version 2 now. Both groups end with a turn of version 2; the first turns differ.
            stale, fresh = (
                episode_group("stale", 2, [0, 1], first_turn=0),
                episode_group("fresh", 2, [0, 1], 1),
            )
            acks = [a async for a in client.submit(batches(stale, fresh))]
            assert final(acks) == {
                **dict.fromkeys(["stale-0", "stale-1"], Disposition.DROPPED),  # 2 versions old: over 1
                **dict.fromkeys(["fresh-0", "fresh-1"], Disposition.TRAINED),
            }
            assert (await client.status()).dropped_samples == 2
    finally:
        await server.stop(grace=1)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    # Two model tokens of each turn per sample; the three context tokens carry no version.
    assert last["lag_histogram"] == {"1": 4, "0": 4} and last["completion_tokens"] == 8


async def test_a_restart_that_lost_versions_does_not_age_the_tokens_made_before_it(tmp_path: Path) -> None:
    """Versions 1-3 were published and lost (no checkpoint holds them): the trainer resumes as
    version 4 with the weights of 0, so a token of version 0 is no step old, to the lag policy, to
    the lag histogram and to the bound on each token's lag alike."""
    CheckpointDir(tmp_path / "checkpoints").record_published(3)
    config = settings(tmp_path, LagPolicy.DROP, max_lag=0).model_copy(
        update={
            "checkpoint_dir": tmp_path / "checkpoints",
            "learner": LearnerConfig(lr=1e-3, loss=LossConfig(max_token_lag=0)),
        }
    )
    server = await build(config)
    await server.start()
    try:
        async with TrainerClient(server.address) as client:
            assert (await client.status()).version.version == 4
            acks = [a async for a in client.submit(batches(episode_group("pre", 0, [0, 1])))]
            assert final(acks) == dict.fromkeys(["pre-0", "pre-1"], Disposition.TRAINED)
    finally:
        await server.stop(grace=1)
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["version"] == 5
    assert last["lag_histogram"] == {"0": 8}
    # Counted 4 versions old, every token would have left the loss: a loss of exactly 0.
    assert last["clip_fraction"] < 1 and last["loss"] != 0


def test_wait_needs_a_positive_max_lag() -> None:
    with pytest.raises(ValidationError, match="max_lag >= 1"):
        TrainerSettings(lag_policy=LagPolicy.WAIT, max_lag=0)
