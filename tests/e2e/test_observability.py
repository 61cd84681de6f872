"""A `pipelinerl run` watched from outside while it runs: every service's `/metrics` scraped and
parsed with prometheus-client's parser shows exactly the documented series, and they move
(versions rise, samples are counted). Afterwards the trainer's TensorBoard events and offline W&B
run hold the reward, lag and ESS series, and `pipelinerl trace` follows one trained attempt
through the log of every service."""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from pipelinerl.launcher.config import RunSettings
from pipelinerl.launcher.processes import ServiceProcess
from pipelinerl.launcher.report import read_evaluations, read_points
from pipelinerl.launcher.run import launch
from tests.observability_docs import documented_metrics
from tests.tracking import tensorboard_series, wandb_series

pytestmark = pytest.mark.slow

BUDGET = 1536
SECTIONS = {
    "coordinator": "Coordinator",
    "inference": "Inference",
    "evaluation": "Inference",
    "trainer": "Trainer",
    "reward": "Reward",
}
Scrape = dict[str, Metric]


def scrape(address: str) -> Scrape:
    body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {family.name: family for family in text_string_to_metric_families(body)}


async def scrape_all(addresses: dict[str, str]) -> dict[str, Scrape]:
    return {name: await asyncio.to_thread(scrape, address) for name, address in addresses.items()}


def exposed(families: Scrape) -> set[str]:
    """Metric names as an exposition shows them (the parser drops a counter's `_total`), less the
    `_created` series prometheus-client adds."""
    names = {f"{f.name}_total" if f.type == "counter" else f.name for f in families.values()}
    return {name for name in names if not name.endswith("_created")}


def value(families: Scrape, name: str, **labels: str) -> float:
    family = families[name]
    return sum(
        s.value
        for s in family.samples
        if s.labels.items() >= labels.items() and s.name in (name, f"{name}_total")
    )


def progress(scrapes: dict[str, Scrape]) -> dict[str, float]:
    """The series that must rise while a run goes on, one per service."""
    return {
        "trainer version": value(scrapes["trainer"], "pipelinerl_trainer_version"),
        "trainer trained": value(scrapes["trainer"], "pipelinerl_trainer_samples", disposition="trained"),
        "inference version": value(scrapes["inference-0"], "pipelinerl_inference_weight_version"),
        # The evaluation server (nice 10) applies a version a little after the training server.
        "evaluation version": value(scrapes["evaluation-0"], "pipelinerl_inference_weight_version"),
        "inference sequences": value(scrapes["inference-0"], "pipelinerl_inference_sequences"),
        "reward scored": value(scrapes["reward"], "pipelinerl_reward_items", status="scored"),
        "coordinator trained": value(
            scrapes["coordinator"], "pipelinerl_coordinator_stage_attempts", stage="trained"
        ),
    }


async def test_a_run_is_seen_in_metrics_tracking_and_logs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    tracking = {"tensorboard": True, "wandb": "offline"}
    settings = RunSettings(
        run_dir=run_dir,
        max_samples=BUDGET,
        samples_per_step=32,
        duration_s=300,
        log_level="debug",  # the per-attempt lines that `pipelinerl trace` shows
        trainer={"tracking": tracking},
        eval=["builtin:copy:2"],
        eval_every=8,
    )
    processes: list[ServiceProcess] = []
    run = asyncio.create_task(launch(settings, processes=processes))
    targets = run_dir / "prometheus_targets.json"
    while not targets.exists():
        assert not run.done(), run.result()
        await asyncio.sleep(0.2)
    addresses = {t["labels"]["instance"]: t["targets"][0] for t in json.loads(targets.read_text())}
    assert set(addresses) == {"reward", "trainer", "inference-0", "evaluation-0", "coordinator"}

    first = await scrape_all(addresses)
    later = first
    while not all(progress(later)[k] > v for k, v in progress(first).items()):
        assert not run.done(), f"the run ended before every series moved: {progress(first)} {progress(later)}"
        await asyncio.sleep(0.5)
        later = await scrape_all(addresses)
    result = await run
    assert result.state == "completed" and result.trained > 0
    # the progress points carry what shows a collapse: an entropy estimate, a zero-variance fraction
    points = read_points(run_dir / "metrics.jsonl")
    assert any(0 < point.entropy < 10 for point in points)
    assert all(0 <= point.zero_variance <= 1 for point in points)
    assert value(later["coordinator"], "pipelinerl_coordinator_entropy_nats", run="run") > 0

    documented = documented_metrics()
    for instance, families in later.items():
        section = SECTIONS[instance.split("-")[0]]
        names = exposed(families)
        assert documented[section] <= names, f"{instance} lacks {documented[section] - names}"
        ours = {n for n in names if n.startswith("pipelinerl_") and not n.startswith("pipelinerl_grpc_")}
        assert ours <= documented[section], f"{instance} serves undocumented {ours - documented[section]}"
        assert documented["gRPC, every service"] <= names
    submits = value(later["trainer"], "pipelinerl_grpc_server_started", grpc_method="SubmitSamples")
    assert submits >= 1

    assert value(later["coordinator"], "pipelinerl_coordinator_eval_weight_version", run="run",
                 dataset="builtin:copy:2") >= 0  # fmt: skip
    # Every evaluation ran on the evaluation server, which followed the trainer; none held up the
    # training server at a version.
    evaluation_server = next(p.address for p in processes if p.name == "evaluation-0")
    evaluations = read_evaluations(run_dir / "metrics.jsonl")
    assert len(evaluations) >= 2 and {e.evaluation["server"] for e in evaluations} == {evaluation_server}
    assert value(later["inference-0"], "pipelinerl_inference_weight_pinned_waits") == 0
    for series in (tensorboard_series(run_dir / "tensorboard"), wandb_series(run_dir / "wandb")):
        for name in ("reward_mean", "lag_mean", "ess"):
            steps = [step for step, _ in series[name]]
            assert len(steps) >= 10 and steps == sorted(set(steps)), name
        # each held-out evaluation at the weight version that generated it
        held_out = [step for step, _ in series["eval/builtin:copy:2/pass_at_1"]]
        assert held_out[0] < 8 and held_out == sorted(set(held_out)) and len(held_out) >= 2, held_out

    journal = sqlite3.connect(run_dir / "journal.sqlite")
    [(attempt,)] = journal.execute("SELECT sample_id FROM attempts WHERE disposition = 'trained' LIMIT 1")
    journal.close()
    cli = Path(sys.executable).parent / "pipelinerl"
    traced = subprocess.run([cli, "trace", str(run_dir), attempt], capture_output=True, text=True, timeout=60)
    assert traced.returncode == 0, traced.stderr
    lines = traced.stdout.splitlines()
    assert lines[0].startswith(f"attempt {attempt} of group ") and "acked (trained)" in lines[0]
    services = {line.split()[0] for line in lines[2:]}
    assert services == {"coordinator", "inference-0", "reward", "trainer"}
    group, run = re.match(r"attempt \S+ of group (\S+), run (\S+):", lines[0]).groups()  # type: ignore[union-attr]
    generated = [line for line in lines if line.startswith("inference-0") and " generated " in line]
    assert generated and all(f"group_id={group}" in line and f"run={run}" in line for line in generated)
    assert any(line.startswith("trainer") and "disposition=trained" in line for line in lines)
