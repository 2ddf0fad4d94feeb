"""tools/check.py, the learner's `make check-N`: what it prints on a file that does not load, on the stubs, on a
half-solved and on a solved file (run as a subprocess, as make does; lesson 3's checks are the fastest)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow   # five subprocesses, each starting pytest: ~5 s each on a quiet machine

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "lessons" / "03_gqa" / "exercises.py"
SOLVED = """
from tinyserve.gqa import grouped_attention as _g
from tinyserve.roofline import attention_decode_bytes as _b

def grouped_attention(q, k, v):
    return _g(q, k, v)

def attention_decode_bytes(config, context, bytes_per_value=4, repeat_kv=False):
    return _b(config, context, bytes_per_value, repeat_kv)
"""


def check(path: Path, *args: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TINYSERVE_EXERCISES_FILE": str(path)}
    env.pop("TINYSERVE_IMPL", None)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "check.py"), "3", *args], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    return r.returncode, r.stdout + r.stderr


def test_a_syntax_error_is_shown_with_file_and_line(tmp_path):
    bad = tmp_path / "exercises.py"
    bad.write_text(STUB.read_text().replace("def attention_decode_bytes(", "def attention_decode_bytes(:", 1))
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if "def attention_decode_bytes(:" in t)
    code, out = check(bad)
    assert code == 1
    assert f"exercises.py:{line}: SyntaxError" in out, out
    assert "Well done" not in out and "0 of 0" not in out


def test_the_stubs_are_todo_and_never_well_done():
    code, out = check(STUB)
    assert code == 1
    assert out.count("TODO") == 2 and "0 of 2 exercises pass" in out and "Well done" not in out, out
    assert "PASSED" not in out and "FAILED" not in out and "%]" not in out, "no raw pytest output"


def test_half_solved_says_what_each_failing_check_expected(tmp_path):
    half = tmp_path / "exercises.py"
    half.write_text(STUB.read_text() + SOLVED.replace("return _b(config, context, bytes_per_value, repeat_kv)",
                                                      "return _b(config, context, bytes_per_value, repeat_kv) // 2"))
    code, out = check(half)
    assert code == 1
    assert "PASS  grouped_attention" in out and "FAIL  attention_decode_bytes" in out, out
    assert "2 (K and V) * 30 layers" in out, "the check's own words explain the expectation"
    assert "1 of 2 exercises pass" in out and "Well done" not in out


@pytest.mark.parametrize("one", [False, True])
def test_solved_is_well_done(tmp_path, one):
    solved = tmp_path / "exercises.py"
    solved.write_text(STUB.read_text() + SOLVED)
    code, out = check(solved, *(["--ex", "attention_decode_bytes"] if one else []))
    assert code == 0 and "Well done!" in out, out
    assert ("1 of 1" if one else "2 of 2") in out
