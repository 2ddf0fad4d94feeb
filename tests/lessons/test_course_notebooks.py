"""Lessons 1-5 as notebooks that survive a busy machine: every floor divides by the course's one bandwidth
(course.machine()), every timed comparison is preceded by a load check (course.busy_check), and the committed
notebooks carry no outputs.
Executing them is `make lesson-N`'s job; this reads their source."""
import ast
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
BOOKS = {n: next((ROOT / "lessons").glob(f"{n:02d}_*/lesson.ipynb")) for n in range(1, 6)}
# lessons 6-11 (lesson 7 is two notebooks): the same bandwidth rule
LATER = {f"{p.parent.name[:2]}{p.stem[-1] if p.stem[-1] in 'ab' else ''}": p
         for n in range(6, 12) for p in sorted((ROOT / "lessons").glob(f"{n:02d}_*/lesson*.ipynb"))}
# a lesson may name another bound than the course's bandwidth when its path cannot reach it; it says why in the text
OTHER_BOUND = {3: "one core"}


def code_of(n: int) -> str:
    nb = nbformat.read(BOOKS[n], as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("n", sorted(BOOKS))
def test_committed_without_outputs_and_every_cell_parses(n):
    nb = nbformat.read(BOOKS[n], as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, f"lesson {n} cell {i} has outputs: clear them"
            ast.parse(re.sub(r"^\s*[%!].*$", "", cell.source, flags=re.M), f"lesson {n} cell {i}")


@pytest.mark.parametrize("n", sorted(BOOKS))
def test_floors_divide_by_the_course_bandwidth(n):
    src = code_of(n)
    if "bandwidth" in src or "check_floor(" in src:
        assert "course.machine()" in src, f"lesson {n} does not take the course's one bandwidth (course.machine())"
    own = re.findall(r"\b(?:roofline|rl)\.measure_bandwidth\(", src)
    if n in OTHER_BOUND:
        text = "\n".join(c.source for c in nbformat.read(BOOKS[n], as_version=4).cells if c.cell_type == "markdown")
        assert OTHER_BOUND[n] in text, f"lesson {n} measures its own bandwidth without saying which bound and why"
    else:
        assert not own, f"lesson {n} measures a bandwidth of its own: divide by course.machine().bandwidth"
    assert "getloadavg" not in src, f"lesson {n}: use course.busy_check, not the load average"


@pytest.mark.parametrize("n", sorted(BOOKS))
def test_every_timed_verdict_follows_a_load_check(n):
    src = code_of(n)
    verdicts = [m.start() for m in re.finditer(r"check_(?:prediction|floor)\(", src)]
    checks = [m.start() for m in re.finditer(r"busy_check\(", src)]
    assert checks, f"lesson {n} times comparisons without course.busy_check"
    if n != 4:   # lesson 4's first verdicts are allocator counts, not timings
        assert checks[0] < verdicts[0], f"lesson {n}: its first verdict comes before any load check"
    assert "course.explain(" in src, f"lesson {n}: a failed verdict needs course.explain (busy, or a computed why)"


@pytest.mark.parametrize("name", sorted(LATER))
def test_later_lessons_take_the_course_bandwidth_and_judge_one_way(name):
    nb = nbformat.read(LATER[name], as_version=4)
    src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert not re.findall(r"\b(?:roofline|rl|rf)\.measure_bandwidth\(", src), \
        f"lesson {name} measures a bandwidth of its own: divide by course.machine().bandwidth"
    if ".bandwidth" in src or "check_floor(" in src:
        assert "machine()" in src, f"lesson {name} does not take the course's one bandwidth (course.machine())"
    for helper in ("def judged(", "def floor_verdict("):
        assert helper not in src, f"lesson {name} judges with its own {helper[4:-1]}: use course.explain / check_floor"
    if "check_prediction(" in src and "busy_check(" in src:
        assert re.search(r"\bexplain\(", src), f"lesson {name}: a failed timed verdict needs course.explain"
