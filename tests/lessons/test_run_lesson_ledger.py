"""tools/run_lesson.py's verdict ledger: a quiet and a busy run's verdicts side by side. A verdict that flips between
the runs must say the machine was too busy, or the compare reports it (and exits 1)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("run_lesson", ROOT / "tools" / "run_lesson.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def findings(*rows):
    return [dict(r) for r in rows]


QUIET = findings(
    {"finding": "bandwidth used: 30.0 GB/s", "kind": "machine", "bandwidth": 30e9},
    {"finding": "step at B=16: predicted 7.4 ms, measured 8 ms", "what": "step at B=16", "holds": True,
     "kind": "prediction", "busy": False},
    {"finding": "1.3 req/s: delivered tokens/s: ...", "what": "1.3 req/s: delivered tokens/s", "holds": True,
     "kind": "prediction", "busy": False},
    {"finding": "floor: ...", "what": "decode step, fp32", "holds": True, "kind": "floor", "busy": False},
)
BUSY = findings(
    {"finding": "bandwidth used: 20.0 GB/s", "kind": "machine", "bandwidth": 20e9},
    {"finding": "...", "what": "step at B=16", "holds": False, "kind": "prediction", "busy": True},
    {"finding": "...", "what": "0.9 req/s: delivered tokens/s", "holds": False, "kind": "prediction", "busy": False},
    {"finding": "...", "what": "decode step, fp32", "holds": True, "kind": "floor", "busy": True},
)


def test_a_flip_under_load_is_same_only_when_the_busy_run_said_too_busy(runner):
    quiet, busy = runner.ledger_rows(8, QUIET), runner.ledger_rows(8, BUSY)
    assert [r["key"] for r in quiet] == [r["key"] for r in busy], "numbers in a claim must not split its pair"
    table, differ = runner.compare(quiet, busy)
    row = lambda key: next(line for line in table.splitlines() if f" {key} " in line)   # noqa: E731
    assert row("step at B=#").endswith("said too busy")
    assert row("# req/s: delivered tokens/s").endswith("DIFFERS"), "a quiet-looking flip is reported"
    assert row("decode step, fp#").endswith("same")
    assert differ == 1


def test_explain_finding_load_after_the_timing_marks_the_verdict_too_busy(runner):
    rows = BUSY + [{"finding": "x", "kind": "too_busy", "what": "0.9 req/s: delivered tokens/s"}]
    _, differ = runner.compare(runner.ledger_rows(8, QUIET), runner.ledger_rows(8, rows))
    assert differ == 0


def test_compare_reads_ledger_files_and_exits_1_on_a_difference(runner, tmp_path, capsys):
    a, b = tmp_path / "quiet.json", tmp_path / "busy.json"
    a.write_text(json.dumps({"bandwidth": None, "verdicts": runner.ledger_rows(8, QUIET)}))
    b.write_text(json.dumps({"bandwidth": None, "verdicts": runner.ledger_rows(8, BUSY)}))
    assert runner.main(["--compare", str(a), str(b)]) == 1
    assert "DIFFERS" in capsys.readouterr().out
    assert runner.main(["--compare", str(a), str(a)]) == 0
    assert runner.main(["--compare", str(a), str(tmp_path / "missing.json")]) == 2
    assert "not a ledger" in capsys.readouterr().out


def test_a_lesson_that_used_another_bandwidth_is_named(runner):
    run_bw = {"bandwidth": 30e9, "bandwidth_lo": 28e9, "bandwidth_hi": 33e9}
    assert "DIFFERENT" in runner.check_bandwidth(2, [20e9], run_bw)
    assert "within its spread" in runner.check_bandwidth(2, [30e9, 29e9], run_bw)


def test_a_verdict_that_held_only_in_the_busy_run_is_marked_busy_not_same(runner):
    quiet = runner.ledger_rows(9, [{"finding": "x", "what": "naive", "holds": False, "busy": False}])
    busy = runner.ledger_rows(9, [{"finding": "x", "what": "naive", "holds": True, "busy": True}])
    table, differ = runner.compare(quiet, busy)
    assert "said busy (held anyway)" in table and differ == 0
    busy[0]["busy"] = False                            # the same flip on a machine that looked quiet is a difference
    assert runner.compare(quiet, busy)[1] == 1
