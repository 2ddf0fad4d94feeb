"""The course's prediction rule (course.check_prediction): within 1.5x holds, outside does not, and a comparison
whose interleaved rounds fall on both sides of 1 does not hold whatever its median says."""
import json

import numpy as np
import pytest

from tinyserve import course


@pytest.fixture(autouse=True)
def no_earlier_load(monkeypatch):
    """Each test starts with no busy_check behind it (the window is process state)."""
    monkeypatch.setattr(course, "_last_load", None)
    monkeypatch.setattr(course, "_window", None)


@pytest.fixture
def build(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_BUILD", str(tmp_path))
    return tmp_path


def test_a_number_within_the_tolerance_holds_either_way(build):
    assert course.check_prediction("step", 10.0, 14.9, "ms").holds
    assert course.check_prediction("step", 10.0, 6.7, "ms").holds
    assert not course.check_prediction("step", 10.0, 15.1, "ms").holds
    assert not course.check_prediction("step", 10.0, 6.6, "ms").holds


def test_a_comparison_needs_every_round_on_the_predicted_side(build):
    assert course.check_prediction("grouped / repeat", 0.5, 0.6, rounds=[0.55, 0.6, 0.7]).holds
    flipped = course.check_prediction("grouped / repeat", 0.8, 0.95, rounds=[0.9, 0.95, 1.05])
    assert not flipped.holds, "a round above 1 contradicts 'grouped is faster', though the median is within 1.5x"
    assert "both sides" in str(flipped)
    assert not course.check_prediction("faster", 2.0, 1.0, rounds=[1.0, 1.0]).holds  # a tie is not 'faster'


def test_the_verdict_is_printed_and_recorded_with_its_numbers(build, capsys):
    v = course.check_prediction("bandwidth", 30.0, 90.0, "GB/s")
    out = capsys.readouterr().out
    assert "DOES NOT HOLD" in out and "3.00x" in out and not v.holds
    row = json.loads((build / "findings.jsonl").read_text().splitlines()[-1])
    assert row["predicted"] == 30.0 and row["measured"] == 90.0 and row["holds"] is False


@pytest.mark.parametrize("predicted, measured", [(0.0, 1.0), (-1.0, 1.0), (1.0, float("nan")), (1.0, -2.0)])
def test_nonsense_numbers_are_refused(build, predicted, measured):
    with pytest.raises(ValueError, match="prediction needs"):
        course.check_prediction("x", predicted, measured)


def test_a_predicted_tie_is_judged_by_the_tolerance_alone(build):
    assert course.check_prediction("paged / contiguous", 1.0, 1.1, rounds=[0.9, 1.1, 1.2]).holds


# --- the course's one machine probe and its load check ----------------------------------------------------------

def test_machine_probe_is_measured_once_per_run(tmp_path, monkeypatch):
    from tinyserve import course
    monkeypatch.setattr(course, "_machine_path", lambda: tmp_path / "machine.json")
    monkeypatch.setenv(course.RUN_ENV, "run-a")
    m = course.machine(rounds=1)
    assert m.bandwidth_lo <= m.bandwidth <= m.bandwidth_hi and m.bandwidth > 0 and m.flops > 0
    assert course.machine() == m                       # the same run: the cached probe, not a new one
    monkeypatch.setenv(course.RUN_ENV, "run-b")
    assert course.machine(rounds=1).run == "run-b"     # a new run of the course measures again


def test_busy_check_sees_a_competing_process():
    import subprocess
    import sys
    import time
    from tinyserve import course
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        load = course.busy_check("a busy loop beside us", seconds=0.5)
    finally:
        spin.kill()
    assert load.busy and load.other_cores >= 0.8, load


# --- floors, the text after a verdict, robust fits --------------------------------------------------------------

def test_a_floor_holds_at_or_above_it_and_says_by_how_much(build, capsys):
    f = course.check_floor("decode step", 16.0, 40.0, "ms", bound="538 MB / 33 GB/s")
    assert f.holds and f.ratio == 2.5 and abs(f.explained - 0.4) < 1e-12
    assert "2.50x the floor" in capsys.readouterr().out
    assert not course.check_floor("decode step", 16.0, 12.0, "ms").holds        # faster than a bound: the bound is wrong
    assert course.check_floor("decode step", 16.0, 14.0, "ms", spread=1.2).holds  # within the probe's own spread
    assert not course.check_floor("decode step", 16.0, 13.0, "ms", spread=1.2).holds
    row = json.loads((build / "findings.jsonl").read_text().splitlines()[-1])
    assert row["kind"] == "floor" and row["holds"] is False


def test_a_floor_far_above_is_still_a_floor_not_an_estimate(build):
    # check_prediction would call 16x a miss; a floor is respected however far above it the measurement is
    assert course.check_floor("naive step", 10.0, 160.0, "ms").holds
    assert not course.check_prediction("naive step", 10.0, 160.0, "ms").holds


@pytest.mark.parametrize("floor, measured, spread", [(0.0, 1.0, 1.0), (1.0, float("inf"), 1.0), (1.0, 1.0, 0.5)])
def test_nonsense_floors_are_refused(build, floor, measured, spread):
    with pytest.raises(ValueError, match="floor needs"):
        course.check_floor("x", floor, measured, spread=spread)


def test_explain_says_busy_instead_of_a_why_and_nothing_when_it_holds(build, capsys, monkeypatch):
    monkeypatch.setattr(course, "busy_check", lambda what, **kw: course.Load(what, 0.0, 2))   # quiet after, too
    failed = course.check_prediction("step", 10.0, 30.0, "ms")
    busy, quiet = course.Load("x", 1.2, 2), course.Load("x", 0.1, 2)
    assert "too busy" in course.explain(failed, busy, "the LM head")
    assert "the LM head" not in course.explain(failed, busy, "the LM head")
    assert course.explain(failed, quiet, lambda: f"{30 / 10:.1f}x") == "  why: 3.0x"
    assert course.explain(course.check_prediction("step", 10.0, 11.0, "ms"), busy, "x") == ""


def test_theil_sen_ignores_a_plateau_that_least_squares_follows():
    x = np.arange(100.0)
    y = 5.0 + 2.0 * x
    y[60:75] = 5000.0                                     # another program's burst: 15 % of the points
    slope, intercept = course.theil_sen(x, y)
    assert abs(slope - 2.0) < 1e-9 and abs(intercept - 5.0) < 1e-9
    assert abs(np.polyfit(x, y, 1)[0] - 2.0) > 5          # least squares is dragged off by the burst
    with pytest.raises(ValueError, match="distinct x"):
        course.theil_sen([1.0, 1.0], [2.0, 3.0])


def test_interleaved_times_every_case_in_every_round():
    calls = []
    out = course.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1)
    assert calls == ["a", "b"] * 4 and all(len(v) == 3 and min(v) >= 0 for v in out.values())


def test_interleaved_stops_at_its_budget_but_keeps_two_rounds():
    import time as _time
    out = course.interleaved({"slow": lambda: _time.sleep(0.02)}, rounds=50, warmup=0, budget_s=0.01)
    assert len(out["slow"]) == 2


def test_a_verdict_records_the_load_of_the_latest_busy_check(build, monkeypatch):
    monkeypatch.setattr(course, "_last_load", course.Load("x", 1.5, 2))
    course.check_prediction("step", 10.0, 11.0, "ms")
    course.check_floor("step", 10.0, 11.0, "ms")
    rows = [json.loads(r) for r in (build / "findings.jsonl").read_text().splitlines()]
    assert [(r["busy"], r["busy_cores"]) for r in rows] == [(True, 1.5), (True, 1.5)]


def test_explain_samples_the_load_again_when_it_started_during_the_timing(build, monkeypatch):
    failed = course.check_prediction("step", 10.0, 30.0, "ms")
    monkeypatch.setattr(course, "busy_check", lambda what, **kw: course.Load(what, 1.0, 2))   # one busy loop now
    assert "too busy" in course.explain(failed, course.Load("x", 0.1, 2), "a why that must not be printed")
    rows = [json.loads(r) for r in (build / "findings.jsonl").read_text().splitlines()]
    assert rows[-1]["kind"] == "too_busy" and rows[-1]["what"] == "step"


def test_a_lesson_notes_the_bandwidth_it_used(build, tmp_path, monkeypatch):
    m = course.Machine(30e9, 28e9, 33e9, 1e11, 9e10, 1.1e11, 2, "cpu", "run-1", 0.0, 0.0)
    course._note_machine(m)
    row = json.loads((build / "findings.jsonl").read_text().splitlines()[-1])
    assert row["kind"] == "machine" and row["bandwidth"] == 30e9 and row["run"] == "run-1"


def test_load_that_starts_after_the_busy_check_is_seen_over_the_window(build, monkeypatch):
    """busy_check sees a quiet machine; then another program takes a core for the rest of the timing: the verdict
    is recorded busy (the window from the busy_check to the verdict), and a failure says too busy."""
    ticks = iter([(0, 0), (10, 200), (10, 200), (110, 400)])        # busy_check: 5 % busy; window: 1 core busy
    monkeypatch.setattr(course, "_cpu_ticks", lambda: next(ticks))
    monkeypatch.setattr(course, "_own_seconds", lambda: 0.0)         # none of it was ours
    monkeypatch.setattr(course.time, "sleep", lambda s: None)
    monkeypatch.setattr(course.os, "cpu_count", lambda: 2)
    assert not course.busy_check("x").busy
    v = course.check_prediction("step", 10.0, 30.0, "ms")
    row = json.loads((build / "findings.jsonl").read_text().splitlines()[-1])
    assert row["busy"] is True and row["busy_cores"] == 1.0


def test_our_own_threads_are_not_other_programs(build, monkeypatch):
    ticks = iter([(0, 0), (0, 200), (0, 200), (200, 400)])          # the window: both cores busy...
    monkeypatch.setattr(course, "_cpu_ticks", lambda: next(ticks))
    own = iter([0.0, 2.0])                                          # ...all of it our own 2 CPU seconds
    monkeypatch.setattr(course, "_own_seconds", lambda: next(own))
    monkeypatch.setattr(course.time, "sleep", lambda s: None)
    monkeypatch.setattr(course.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(course, "_HZ", 100)
    course.busy_check("x")
    assert course.window_load().other_cores == 0.0
