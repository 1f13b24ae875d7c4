"""Ctrl-C while a checkpoint is written: held until the block ends, then given to the run's handler
(real signals sent to this process; no models)."""

import os
import signal

import pytest

from agentopd.interrupts import catch_ctrl_c, writes_uninterrupted


def _ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture(autouse=True)
def default_handler():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_in_a_write_waits_for_the_write_then_stops():
    held, done = [], []
    with pytest.raises(KeyboardInterrupt):
        with writes_uninterrupted(lambda: held.append(True)):
            _ctrl_c()
            _ctrl_c()
            done.append("written")  # the block finishes: a checkpoint is never left half-written
    assert done == ["written"] and held == [True]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_no_ctrl_c_no_interrupt():
    with writes_uninterrupted():
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_first_ctrl_c_in_a_write_only_asks_to_stop_a_second_stops_now():
    asked = []
    undo = catch_ctrl_c(lambda: asked.append(True))
    try:
        with writes_uninterrupted():
            _ctrl_c()
        assert asked == [True]  # the run's first-stage handler got it: stop after this step, no exception
        with pytest.raises(KeyboardInterrupt):
            with writes_uninterrupted():
                _ctrl_c()
    finally:
        undo()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_two_ctrl_c_in_one_write_are_both_replayed():
    asked = []
    undo = catch_ctrl_c(lambda: asked.append(True))
    try:
        with pytest.raises(KeyboardInterrupt):
            with writes_uninterrupted():
                _ctrl_c()
                _ctrl_c()
        assert asked == [True]
    finally:
        undo()
