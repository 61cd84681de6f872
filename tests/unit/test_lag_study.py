"""`benchmarks/lag_study.py`'s figures from recorded runs: paired gaps against the same seeds at
lag 0, Student-t intervals, and the grid it runs."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.lag_study import analyse, grid, mean_ci


def _run(loss: str, lag: int, seed: int, reward: float, kl: float = 0.01) -> dict:
    return {
        "task": "copy",
        "loss": loss,
        "lr": 3e-4,
        "lag": lag,
        "seed": seed,
        "reward_mean": reward,
        "step_kl": kl,
    }


def test_the_interval_is_students_t_over_the_seeds() -> None:
    mean, half = mean_ci([0.1, 0.2, 0.3])
    assert mean == pytest.approx(0.2)
    assert half == pytest.approx(4.303 * 0.1 / 3**0.5)  # t(0.975, 2 df) x sd / sqrt(n)
    assert mean_ci([0.5]) == (0.5, None)


def test_gaps_are_paired_by_seed_against_the_default_loss() -> None:
    # Seeds differ a lot from each other, lag 1 costs exactly 0.01 on every seed: a paired
    # difference sees the cost with no spread, an unpaired one would drown it.
    base = [_run("default", 0, seed, reward) for seed, reward in enumerate((0.2, 0.5, 0.8))]
    lagged = [_run("default", 1, seed, reward - 0.01) for seed, reward in enumerate((0.2, 0.5, 0.8))]
    corrected = [_run("m2po", 1, seed, reward) for seed, reward in enumerate((0.2, 0.5))]  # a seed short
    points = {(p["loss"], p["lag"]): p for p in analyse(base + lagged + corrected)}

    assert points[("default", 0)]["gap"] is None
    assert points[("default", 1)]["gap"] == pytest.approx(-0.01)
    assert points[("default", 1)]["gap_ci"] == pytest.approx(0.0, abs=1e-9)
    assert points[("m2po", 1)]["gap"] == pytest.approx(0.0) and points[("m2po", 1)]["seeds"] == 2
    # a correction is also compared with the default loss at its own lag, on the seeds both ran
    assert points[("m2po", 1)]["vs_default"] == pytest.approx(0.01)
    assert points[("default", 1)]["vs_default"] is None


def test_the_grid_runs_corrections_only_with_lag_and_seeds_outermost() -> None:
    args = argparse.Namespace(
        seeds=2, tasks=["copy"], lrs=[3e-4], lags=[0, 1], losses=["default", "m2po"], in_flight=False
    )
    runs = grid(args)
    assert [(r["seed"], r["loss"], r["lag"]) for r in runs] == [
        (0, "default", 0), (0, "default", 1), (0, "m2po", 1),
        (1, "default", 0), (1, "default", 1), (1, "m2po", 1),
    ]  # fmt: skip
    assert not any(r["in_flight"] for r in runs)


def test_updates_in_flight_are_points_of_their_own_measured_against_lag_0() -> None:
    args = argparse.Namespace(
        seeds=1, tasks=["repeat"], lrs=[3e-4], lags=[0, 2], losses=["default", "token_bound"], in_flight=True
    )
    # lag 0 has no update to arrive in flight
    assert [(r["loss"], r["lag"], r["in_flight"]) for r in grid(args)] == [
        ("default", 0, False),
        ("default", 2, True),
        ("token_bound", 2, True),
    ]
    base = [_run("default", 0, seed, reward) for seed, reward in enumerate((0.3, 0.6))]
    whole = [_run("default", 2, seed, reward - 0.02) for seed, reward in enumerate((0.3, 0.6))]
    in_flight = [
        {**_run("default", 2, seed, reward - 0.01), "in_flight": True}
        for seed, reward in enumerate((0.3, 0.6))
    ]
    bound = [
        {**_run("token_bound", 2, seed, reward - 0.05), "in_flight": True}
        for seed, reward in enumerate((0.3, 0.6))
    ]
    points = {(p["loss"], p["lag"], p["in_flight"]): p for p in analyse(base + whole + in_flight + bound)}

    assert points[("default", 2, False)]["gap"] == pytest.approx(-0.02)
    assert points[("default", 2, True)]["gap"] == pytest.approx(-0.01)  # against lag 0, not lag 2 whole
    # the bound against the default loss with its update in flight, not the one lagged whole
    assert points[("token_bound", 2, True)]["vs_default"] == pytest.approx(-0.04)
