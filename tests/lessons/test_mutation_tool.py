"""tools/mutation.py (`make mutation`), the bounded part CI runs: the equivalents file names only mutants the tool
still makes (a stale entry would hide nothing, but would claim a reason nobody can check any more), and one small
exercise is mutation-tested for real, through the learner switch, and holds the bar (~15 s)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
mutation = pytest.importorskip("mutation", reason="needs cosmic-ray (the test extra): make test installs it")


def test_every_listed_equivalent_is_a_mutant_the_tool_makes():
    made = {}
    from tinyserve.course import course_lessons, exercise_table
    for lesson in course_lessons():
        for name, ref in exercise_table(lesson).items():
            made.update({m.key: m for m in mutation.mutants(mutation.target(name, ref))})
    stale = [key for key in mutation.equivalents() if key not in made]
    assert not stale, f"tests/lessons/equivalent_mutants.txt lists mutants the tool no longer makes: {stale}"


def test_the_mutants_are_the_reference_changed_in_one_place():
    t = mutation.target("attention_decode_bytes", "tinyserve.roofline:attention_decode_bytes")
    ms = mutation.mutants(t)
    assert ms and all(m.source != t.source and m.before != m.after for m in ms)
    assert len({m.key for m in ms}) == len(ms), "no mutant twice"


def test_every_exercise_gives_mutants(tmp_path):
    """A reference with nothing to mutate would score 100 % on no evidence: one that only wraps a helper names it
    in DELEGATES, and then the helper is mutated and the patch calls it through the reference's own wrapper."""
    from tinyserve.course import course_lessons, exercise_table
    empty = [name for lesson in course_lessons() for name, ref in exercise_table(lesson).items()
             if not mutation.mutants(mutation.target(name, ref))]
    assert not empty, f"these exercises' references give no mutants: {empty}"
    t = mutation.target("generate", "tinyserve.kv_cache:generate")
    assert t.name == "generate_stream" and "def generate(" in t.wrapper
    text = mutation.patch_file(t, t.source, tmp_path).read_text()
    assert text.index("def generate_stream(") < text.index("def generate(")


@pytest.mark.slow
def test_a_small_exercise_kills_its_mutants_through_the_learner_switch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TINYSERVE_IMPL", None)
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "mutation.py"), "3", "--ex", "attention_decode_bytes", "--ci"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "attention_decode_bytes" in r.stdout and "1 of 1 exercises at >= 90%" in r.stdout, r.stdout
