"""The Grafana dashboard and the Prometheus scrape config in deploy/: well-formed, laid out on
Grafana's 24-column grid, showing what an RL run is watched by, over documented metrics only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.observability_docs import documented_metrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
HISTOGRAM_SERIES = re.compile(r"_(bucket|sum|count)$")


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "pipelinerl.json").read_text())


def test_the_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    board = dashboard()
    assert board["title"] and board["uid"] and isinstance(board["schemaVersion"], int)
    [variable] = board["templating"]["list"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids repeat"
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        covered = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        assert panel["type"] == "timeseries" and panel["datasource"]["uid"] == "${" + variable["name"] + "}"
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def test_the_dashboard_shows_a_run_over_documented_metrics() -> None:
    panels = {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard()["panels"]}
    for title in ("Reward", "Lag (versions)", "Update stall", "Tokens/s per role", "Samples/s per role"):
        assert title in panels
    roles = {"coordinator", "inference", "trainer", "reward"}
    assert {r for r in roles for expr in panels["Samples/s per role"] if f"pipelinerl_{r}_" in expr} == roles
    documented = set().union(*documented_metrics().values())
    used = {
        HISTOGRAM_SERIES.sub("", name)
        for exprs in panels.values()
        for expr in exprs
        for name in re.findall(r"pipelinerl_\w+", expr)
    }
    assert used <= documented, f"undocumented: {sorted(used - documented)}"


def test_the_scrape_config_has_a_job_per_role() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"coordinator", "inference", "trainer", "reward", "environment"}
    for name, job in jobs.items():
        targets = [t for group in job["static_configs"] for t in group["targets"]]
        assert targets and all(t.startswith(name) and t.endswith(":9100") for t in targets), targets


def test_the_docs_list_every_role_under_its_prefix() -> None:
    sections = documented_metrics()
    assert {"gRPC, every service", "Inference", "Trainer", "Coordinator", "Reward"} <= set(sections)
    for section, names in sections.items():
        role = section.split(",")[0].lower()
        assert all(name.startswith(f"pipelinerl_{role}_") for name in names), section
