"""Which inference servers may take prompts: none before the trainer has told its version; those
within its max_lag, counted from the newest version its acks carry; after a trainer restart, none
holding weights older than the restarted trainer's, and none at all while it retrains the steps it
lost; each admitted again once it has caught up."""

from __future__ import annotations

from pipelinerl.coordinator.lag_gate import LagGate, StreamState


def test_nothing_is_admitted_before_the_trainer_has_told_its_version_and_max_lag() -> None:
    gate = LagGate()
    assert not gate.admits(0)
    gate.status(version=0, max_lag=4)
    assert gate.admits(0)
    assert LagGate(known=True).admits(0)  # a pool without a trainer


def test_a_server_takes_prompts_within_max_lag_of_the_newest_version_acked() -> None:
    gate = LagGate()
    gate.status(version=10, max_lag=4)
    assert gate.admits(6) and not gate.admits(5)
    # The acks of steps taken since the last poll move the floor at once.
    gate.stream(StreamState(version=14, resumed=0, retraining=False))
    assert gate.floor == 10 and not gate.admits(9)
    gate.status(version=12, max_lag=4)  # a poll answered before those acks
    assert gate.floor == 10


def test_after_a_trainer_restart_only_its_own_weights_take_prompts_once_its_replay_is_over() -> None:
    gate = LagGate()
    gate.status(version=20, max_lag=4)
    gate.stream(StreamState(version=20, resumed=0, retraining=False))
    # The trainer died at 20; while it is away the servers on 20 go on generating.
    gate.stream(StreamState(version=20, resumed=-1, retraining=True))
    assert not gate.admits(20)  # resent samples are not answered: a replay may be coming
    # Restarted, it answers with the version it resumed at (21) and retrains the lost steps.
    gate.stream(StreamState(version=21, resumed=21, retraining=True))
    assert not gate.admits(21)
    gate.stream(StreamState(version=28, resumed=21, retraining=False))
    # Replay over: 20 is within max_lag of nothing the trainer will train next; 24 is.
    assert not gate.admits(20) and not gate.admits(23)
    assert gate.admits(24) and gate.admits(28)


def test_a_server_that_catches_up_is_admitted_again() -> None:
    gate = LagGate()
    gate.status(version=3, max_lag=4)
    gate.stream(StreamState(version=9, resumed=9, retraining=False))
    assert not gate.admits(3)  # still on the pre-crash weights
    assert gate.admits(9)  # the restarted trainer's, fetched
