"""`benchmarks/pipeline_vs_sync.py`'s long-tail figures, computed from small recorded inputs: the
completion length distribution from a journal, the batch occupancy from decode counters, and the
plot of the runs' rewards."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from benchmarks.pipeline_vs_sync import (
    OccupancySampler,
    journal_attempts,
    length_figures,
    occupancy_figures,
    quarters,
    read_counters,
    read_occupancy,
    round_spread,
    run_settings,
    token_lag,
)
from pipelinerl.common.types import FinishReason, TokenSequence
from pipelinerl.coordinator.journal import AttemptRecord, GroupRecord, Journal
from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.report import MetricsLog, Point, plot_runs, read_points


def test_length_figures_are_nearest_rank_percentiles() -> None:
    lengths = [2] * 50 + [10] * 40 + [100] * 9 + [161]  # 100 completions
    assert length_figures(lengths) == {
        "p50": 2, "p90": 10, "p99": 100, "max": 161, "mean": 15.61, "p99_over_p50": 50.0,
    }  # fmt: skip
    assert length_figures([7]) == {"p50": 7, "p90": 7, "p99": 7, "max": 7, "mean": 7, "p99_over_p50": 1.0}


def test_round_spread_is_the_median_of_each_rounds_ratio() -> None:
    rounds = [[1, 1, 1, 8], [2, 2, 2, 2], [1, 1, 4, 4], [5]]  # the last, incomplete, is left out
    assert round_spread([n for r in rounds for n in r], round_size=4) == 4.0  # ratios 8, 1, 4
    assert round_spread([1, 2, 3], round_size=4) is None


def test_quarters_cut_the_run_in_order() -> None:
    assert quarters(list(range(10))) == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]


def test_lengths_and_rewards_come_from_the_journal(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite")
    journal.create_run("r", {"dataset": "builtin:repeat"})
    for index, (length, reward) in enumerate([(3, 1.0), (41, 0.5), (161, None)]):
        attempts = [AttemptRecord(f"r-p{index}-a0", "created"), AttemptRecord(f"r-p{index}-a1", "created")]
        journal.add_group("r", GroupRecord(f"r-p{index}", index, "7x2=", "77", "digits", attempts))
        tokens = TokenSequence([5] * length, [-0.1] * length, [0] * length)
        journal.mark_generated(
            [AttemptRecord(f"r-p{index}-a0", "generated", [1], tokens, "7", FinishReason.STOP, "127.0.0.1:1")]
        )
        if reward is not None:
            journal.mark_scored([(f"r-p{index}-a0", reward, reward == 1.0)])
    journal.close()
    # the attempts never generated (a1 of each group) are not completions
    assert journal_attempts(tmp_path) == [(3, 1.0), (41, 0.5), (161, None)]


def test_occupancy_is_rows_over_steps_per_decode_step_not_per_second() -> None:
    # (seconds, decode steps, decoded rows) read each second: 100 steps of 64 rows a second for
    # 4 s, then a round's tail, 25 steps of 4 rows a second for 4 s. The batch was full half the
    # time, but in 400 of the 500 steps: the mean per step is (400 × 64 + 100 × 4) / 500 = 52 rows.
    samples = [(float(t), 100 * t, 6400 * t) for t in range(5)]
    samples += [(4.0 + t, 400 + 25 * t, 25600 + 100 * t) for t in range(1, 5)]
    figures = occupancy_figures(samples)
    assert figures["mean"] == 52.0
    assert figures["by_quarter"] == [64.0, 64.0, 4.0, 4.0]
    assert occupancy_figures([(0.0, 0, 0)]) == {"mean": 0.0, "by_quarter": []}
    assert occupancy_figures([(0.0, 0, 0), (1.0, 0, 0)])["mean"] == 0.0  # no step: an idle server


EXPOSITION = """# HELP pipelinerl_inference_decode_steps_total Decode steps.
# TYPE pipelinerl_inference_decode_steps_total counter
pipelinerl_inference_decode_steps_total 120.0
pipelinerl_inference_decoded_rows_total 3000.0
pipelinerl_inference_generated_tokens_total 2999.0
pipelinerl_inference_prefill_tokens_total 700.0
pipelinerl_inference_reused_prompt_tokens_total 300.0
"""


def test_counters_are_read_from_an_exposition() -> None:
    assert read_counters(EXPOSITION) == {
        "decode_steps": 120,
        "decoded_rows": 3000,
        "prefill_tokens": 700,
        "reused_prompt_tokens": 300,
    }
    assert read_counters("pipelinerl_inference_decode_steps_total 5.0\n") == {
        "decode_steps": 5,
        "decoded_rows": 0,
        "prefill_tokens": 0,
        "reused_prompt_tokens": 0,
    }
    assert read_counters("pipelinerl_inference_running_sequences 3.0\n") is None


def test_the_sampler_reads_the_run_inference_servers_and_writes_its_series(tmp_path: Path) -> None:
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = EXPOSITION.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        sampler = OccupancySampler(tmp_path, every_s=0.05)
        sampler.start()
        targets = f'[{{"targets": ["127.0.0.1:{server.server_port}"], "labels": {{"job": "inference"}}}}]'
        (tmp_path / "prometheus_targets.json").write_text(targets)
        deadline = time.monotonic() + 10
        while len(sampler.samples) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        sampler.stop()
    finally:
        server.shutdown()
        server.server_close()
    recorded = read_occupancy(tmp_path)
    assert len(recorded) >= 2 and {(steps, rows) for _, steps, rows in recorded} == {(120, 3000)}
    lines = [json.loads(line) for line in (tmp_path / "occupancy.jsonl").read_text().splitlines()]
    assert {(line["prefill_tokens"], line["reused_prompt_tokens"]) for line in lines} == {(700, 300)}


@pytest.mark.parametrize("missing", [True, False])
def test_a_run_without_counters_reads_as_no_steps(tmp_path: Path, missing: bool) -> None:
    if not missing:
        (tmp_path / "occupancy.jsonl").write_text("")
    assert occupancy_figures(read_occupancy(tmp_path))["mean"] == 0.0


def test_token_lag_weighs_the_trainers_histograms_by_token(tmp_path: Path) -> None:
    # a conventional round of two steps: the first trains 30 tokens of lag 0, the second 10 of lag 1
    steps = [{"lag_histogram": {"0": 30}}, {"lag_histogram": {"1": 10}}]
    (tmp_path / "trainer_metrics.jsonl").write_text("".join(json.dumps(step) + "\n" for step in steps))
    assert token_lag(tmp_path) == 0.25


def test_the_runs_rewards_are_read_back_and_drawn_side_by_side(tmp_path: Path) -> None:
    """The comparison plot reads each run's metrics.jsonl as the run wrote it."""
    runs = {}
    for name, slope in (("pipeline", 0.02), ("sync", 0.01)):
        log = MetricsLog(tmp_path / f"{name}.jsonl")
        for second in range(1, 30):
            log.add(
                Point(
                    second,
                    128 * second,
                    min(slope * second, 1.0),
                    0.0,
                    0.5,
                    128.0,
                    second,
                    (second,),
                    0.1,
                    1.0,
                )
            )
        runs[name] = read_points(log.path)
        assert runs[name] == log.points
    path = plot_runs(runs, tmp_path / "reward.png", "builtin:repeat")
    assert path.read_bytes().startswith(b"\x89PNG") and path.stat().st_size > 10_000


def test_the_runs_differ_only_in_their_mode_round_and_the_pipelines_window(tmp_path: Path) -> None:
    args = argparse.Namespace(
        out=str(tmp_path), dataset="builtin:repeat", model="tiny", max_new_tokens=None, seed=3, lr=1e-4,
        samples=4096, max_seconds=60.0, conventional_steps=4, max_in_flight=192, environment=None,
    )  # fmt: skip
    runs = {name: run_settings(name, args) for name in ("pipeline", "sync", "conventional")}
    assert runs["pipeline"].mode == "pipeline" and runs["pipeline"].max_in_flight == 192
    assert runs["sync"].mode == runs["conventional"].mode == "sync"
    assert (runs["sync"].round_steps, runs["conventional"].round_steps) == (1, 4)
    default = RunSettings.model_fields["max_in_flight"].default  # sync mode has no use for it
    assert runs["sync"].max_in_flight == runs["conventional"].max_in_flight == default != 192
    shared = ["dataset", "model", "seed", "lr", "max_samples", "samples_per_step", "group_size"]
    for name, settings in runs.items():
        assert settings.run_dir == tmp_path / name
        assert [getattr(settings, f) for f in shared] == [getattr(runs["pipeline"], f) for f in shared]
    assert (runs["pipeline"].seed, runs["pipeline"].lr, runs["pipeline"].max_samples) == (3, 1e-4, 4096)
