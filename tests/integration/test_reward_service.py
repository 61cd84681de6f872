"""The real reward service over gRPC: math-verify in worker processes, per-item statuses, timeouts."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipelinerl.common.errors import InvalidArgument
from pipelinerl.reward.__main__ import build
from pipelinerl.reward.client import RewardClient
from pipelinerl.reward.config import RewardSettings
from pipelinerl.reward.types import ScoreItem
from pipelinerl.reward.verifiers import RewardSpec, RewardTerm

SLOW_VERIFIER = """
import time


def score(prompt, completion, answer):
    if completion == "hang":
        time.sleep(600)
    return 1.0
"""


@pytest.fixture
async def reward_address(tmp_path: Path):
    verifier = tmp_path / "slow.py"
    verifier.write_text(SLOW_VERIFIER)
    spec = RewardSpec(
        python_function=f"{verifier}:score", extra_terms=[RewardTerm(verifier="format", weight=0.1)]
    )
    server = await build(RewardSettings(port=0, workers=2, timeout_s=1.0, reward=spec))
    await server.start()
    yield server.address
    await server.stop(grace=1)


async def test_batch_scores_with_per_item_statuses(reward_address: str) -> None:
    items = [
        ScoreItem("right", "What is 1/2?", r"So the answer is \boxed{0.5}", r"\frac{1}{2}", "math"),
        ScoreItem("wrong", "What is 1/2?", r"\boxed{3}", r"\frac{1}{2}", "math"),
        ScoreItem("unknown", "p", "c", "a", "astrology"),
        ScoreItem("no-answer", "p", r"\boxed{1}", "", "math"),
        ScoreItem("hang", "p", "hang", "a", "python"),
    ]
    async with RewardClient(reward_address) as client:
        results = {r.sample_id: r for r in await client.score(items, timeout_s=30)}
        assert results["right"].reward == pytest.approx(1.1)  # correct + 0.1 for the boxed format
        assert results["wrong"].reward == pytest.approx(0.1)
        assert {d.verifier for d in results["right"].details} == {"math", "format"}
        for sample_id, field in [("unknown", "items[2].verifier"), ("no-answer", "items[3].answer")]:
            error = results[sample_id].error
            assert (
                error is not None and error.code == "INVALID_ARGUMENT" and results[sample_id].reward is None
            )
            assert [v.field for v in error.violations] == [field]
        assert results["hang"].timed_out and results["hang"].reward is None
        # The service survived the hanging verifier.
        [again] = await client.score([items[0]], timeout_s=30)
        assert again.reward == pytest.approx(1.1)
        assert {v.name for v in await client.list_verifiers()} >= {
            "math",
            "exact",
            "numeric",
            "format",
            "python",
        }
        with pytest.raises(InvalidArgument) as exc:
            await client.score([])
        assert exc.value.violations[0].field == "items"
        stats = await client.status()
        assert (stats.timed_out, stats.invalid, stats.workers) == (1, 2, 2)
        assert stats.scored == 3
