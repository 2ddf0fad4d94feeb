"""Ctrl-C at a safe point (tinyserve/interrupts.py): inside a section SIGINT waits for the section's end, between
sections it interrupts at once, and the handler that was installed before comes back whatever happens."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from tinyserve.interrupts import interrupts_deferred, interrupts_held


def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)


def test_a_section_holds_ctrl_c_until_it_has_ended():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held() as deferred:
            with deferred:
                ctrl_c()
                done.append("rest of the section")
            done.append("after the section")
    assert done == ["rest of the section"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_between_sections_ctrl_c_interrupts_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held() as deferred:
            with deferred:
                done.append("first section")
            ctrl_c()
            done.append("between")                       # never reached: Python's own handler would not wait either
    assert done == ["first section"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sections_are_reusable_and_nest():
    done = []
    with interrupts_held() as deferred:
        for i in range(3):
            with deferred:
                done.append(i)
        with pytest.raises(KeyboardInterrupt):
            with deferred:
                with deferred:
                    ctrl_c()
                done.append("outer section goes on")    # the inner section's end does not deliver it
        done.append("handler still ours")
        with deferred:
            done.append("no stale interrupt")
    assert done == [0, 1, 2, "outer section goes on", "handler still ours", "no stale interrupt"]


def test_an_exception_in_a_section_propagates_and_the_handler_comes_back():
    with pytest.raises(ValueError, match="boom"):
        with interrupts_held() as deferred, deferred:
            ctrl_c()
            raise ValueError("boom")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupts_deferred_is_one_section():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            ctrl_c()
            done.append("rest of the block")
    assert done == ["rest of the block"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_application_handler_is_kept_and_sections_hold_nothing_back():
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    before = signal.signal(signal.SIGINT, mine)
    try:
        with interrupts_held() as deferred, deferred:
            assert signal.getsignal(signal.SIGINT) is mine
            ctrl_c()
            assert seen == [signal.SIGINT]               # delivered to the application at once
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        signal.signal(signal.SIGINT, before)


def test_outside_the_main_thread_nothing_is_installed():
    result = {}

    def body():
        with interrupts_held() as deferred, deferred:
            result["handler"] = signal.getsignal(signal.SIGINT)
            result["ran"] = True

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert result == {"handler": signal.default_int_handler, "ran": True}
