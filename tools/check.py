#!/usr/bin/env python
"""Self-checks for the lesson exercises.

    python tools/check.py 4                       # `make check-4`: lesson 4's checks against YOUR exercises.py
    python tools/check.py 4 --ex plan_step        # `make check-4 EX=plan_step`: one exercise only
    python tools/check.py 4 --ex plan_step -v     # `make check-4 EX=plan_step VERBOSE=1`: full tracebacks
    python tools/check.py --stubs-must-fail all
        # part of `make test`: every exercise check must FAIL on the untouched stubs (as committed in git),
        # because a check that cannot fail teaches nothing. (The same checks pass on the reference: pytest.)
    python tools/check.py --wrong-answers-must-fail all
        # part of `make test`: every kept wrong answer (tests/lessons/wrong_answers/lesson_NN/*.py) must fail at
        # least one check of the exercise its CAUGHT_BY names: the checks catch the mistakes learners make.

The same checks run directly under pytest; TINYSERVE_IMPL says whose code they test (see tests/lessons/impl.py):
    TINYSERVE_IMPL=learner PYTHONPATH=. .venv/bin/python -m pytest tests/lessons/test_lesson_04.py -k plan_step
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
import tokenize
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.lessons.impl import _import_path, lesson_dir  # noqa: E402

TESTS = ROOT / "tests" / "lessons"
WRONG = TESTS / "wrong_answers"


def lessons_with_tests() -> list[int]:
    return sorted(int(p.stem.split("_")[-1]) for p in TESTS.glob("test_lesson_*.py"))


def exercise_names(lesson: int) -> list[str]:
    """The exercises of a lesson, in the order of its test file's REFERENCE table (read without importing it)."""
    tree = ast.parse((TESTS / f"test_lesson_{lesson:02d}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REFERENCE" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


# --- running one lesson's checks in this process -------------------------------------------------------------

@dataclass
class Check:
    test: str
    passed: bool
    message: str = ""       # what was expected, in a few lines (failures only)
    full: str = ""          # the whole traceback (failures only)


@dataclass
class Results:
    checks: dict[str, list[Check]] = field(default_factory=dict)   # exercise -> its checks
    errors: list[str] = field(default_factory=list)                # collection errors (the test file did not load)

    @property
    def ran(self) -> int:
        return sum(len(c) for c in self.checks.values())


class Collector:
    """A pytest plugin: keeps only the exercises asked for, and remembers every check's outcome and message."""

    def __init__(self, only: str | None):
        self.only = only
        self.results = Results()

    def pytest_collection_modifyitems(self, config, items):
        if self.only is None:
            return
        keep = [it for it in items if (m := it.get_closest_marker("exercise")) and m.args[0] == self.only]
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep

    def pytest_collectreport(self, report):
        if report.failed:
            self.results.errors.append(report.longreprtext)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "call" or (report.when == "setup" and report.failed):
            marker = item.get_closest_marker("exercise")
            name = marker.args[0] if marker else "(not an exercise)"
            check = Check(item.name, report.passed)
            if report.failed:
                check.message = explain(call.excinfo)
                check.full = report.longreprtext
            self.results.checks.setdefault(name, []).append(check)


_NUMPY_NOISE = ("Not equal to tolerance", "Arrays are not equal", "Arrays are not almost equal", "x:", "y:",
                "ACTUAL:", "DESIRED:", "Mismatched elements", "Max relative difference", "First ", "Mismatch at ind",
                "Max absolute difference", "Use -v to get", "Full diff:", "At index", "Left contains", "Right contains")


def explain(excinfo, max_lines: int = 4) -> str:
    """A failure in a few lines a learner can act on: the check's own message first, not NumPy's boilerplate."""
    if excinfo is None:
        return ""
    if excinfo.errisinstance(NotImplementedError):
        return "not implemented yet (it still raises NotImplementedError)"
    text = str(excinfo.value)
    if not excinfo.errisinstance(AssertionError):
        # the learner's code raised: say what and where in their file
        where = ""
        for entry in reversed(excinfo.traceback):
            path = str(entry.path)
            if "tests/lessons/" not in path and "site-packages" not in path and "/_pytest/" not in path:
                where = f" (at {Path(path).name}:{entry.lineno + 1})"
                break
        first = text.strip().splitlines()[0][:200] if text.strip() else ""
        return f"{excinfo.typename}: {first}{where}"
    lines, shown_index = [], False
    comment = _test_comment(excinfo)
    if comment and comment not in text:
        lines.append(comment)
    for ln in (ln.rstrip() for ln in text.splitlines() if ln.strip()):
        if ln.lstrip().startswith("[") and "(ACTUAL)" in ln:     # NumPy's first mismatch: worth one line
            if not shown_index:
                lines.append("first difference at " + ln.strip().replace(" (ACTUAL)", " (yours)")
                             .replace(" (DESIRED)", " (expected)"))
                shown_index = True
        elif not ln.lstrip().startswith(_NUMPY_NOISE):
            lines.append(ln)
    if not lines:
        return "the check failed (run with VERBOSE=1 to see it)"
    return "\n".join(ln[:200] for ln in lines[:max_lines])


def _test_comment(excinfo) -> str:
    """The `# comment` on the failing line of the check, if any: the tests explain their expectations there."""
    for entry in reversed(excinfo.traceback):
        if "tests/lessons/" in str(entry.path):
            try:
                source = str(entry.statement)
                tokens = tokenize.generate_tokens(io.StringIO(source).readline)
                return " ".join(t.string.lstrip("# ").strip() for t in tokens if t.type == tokenize.COMMENT)
            except (tokenize.TokenError, IndentationError, SyntaxError):
                return ""
    return ""


def run(lesson: int, exercises: Path | None, mode: str = "learner", only: str | None = None,
        stop_at_first: bool = False) -> Results:
    """Lesson N's checks on `exercises` (default: the learner's exercises.py), in this process, silently."""
    env_backup = dict(os.environ)
    os.environ["TINYSERVE_IMPL"] = mode
    if exercises is not None:
        os.environ["TINYSERVE_EXERCISES_FILE"] = str(exercises)
    # the test module reads TINYSERVE_IMPL when imported: import it afresh for every run
    for name in [m for m in sys.modules if m.startswith(("tests.lessons.test_lesson_", "test_lesson_"))]:
        del sys.modules[name]
    collector = Collector(only)
    args = ["-p", "no:terminal", "-p", "no:cacheprovider", "-p", "no:warnings", "-o", "addopts=",
            "-W", "ignore", str(TESTS / f"test_lesson_{lesson:02d}.py")]
    if stop_at_first:
        args.insert(0, "-x")
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            pytest.main(args, plugins=[collector])
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    return collector.results


# --- the learner's report ------------------------------------------------------------------------------------

def import_problem(path: Path) -> str | None:
    """None if the exercises file imports; else where it breaks (file:line and the line), in a few lines."""
    if not path.exists():
        return f"{path} does not exist"
    try:
        compile(path.read_text(), str(path), "exec")
    except SyntaxError as e:
        text = (e.text or "").rstrip("\n")
        indent = len(text) - len(text.lstrip())
        caret = " " * max((e.offset or 1) - 1 - indent, 0) + "^"
        return (f"{_rel(path)}:{e.lineno}: {e.__class__.__name__}: {e.msg}\n"
                f"    {text.strip()}\n    {caret}")
    try:
        _import_path(path, f"exercises_import_check_{os.getpid()}")
    except Exception as e:   # noqa: BLE001 - any error on import is the learner's to see
        frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
        where = f"{_rel(path)}:{frames[-1].lineno}: " if frames else f"{_rel(path)}: "
        line = f"\n    {frames[-1].line}" if frames and frames[-1].line else ""
        return f"{where}{type(e).__name__} while importing the file: {e}{line}"
    finally:
        sys.modules.pop(f"exercises_import_check_{os.getpid()}", None)
    return None


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def report_learner(lesson: int, only: str | None = None, verbose: bool = False) -> int:
    path = Path(os.environ.get("TINYSERVE_EXERCISES_FILE") or lesson_dir(lesson) / "exercises.py")
    names = exercise_names(lesson)
    print(f"\nLesson {lesson} self-check of YOUR code: {_rel(path)}"
          + (f", exercise {only}" if only else f" ({len(names)} exercises)"))
    if only is not None and only not in names:
        print(f"\n  No exercise called {only!r} in lesson {lesson}; its exercises are: {', '.join(names)}")
        return 2
    problem = import_problem(path)
    if problem:
        print(f"\n  Your file does not load, so no check could run:\n\n  {problem.replace(chr(10), chr(10) + '  ')}\n")
        print("  Fix that line (Python shows where it noticed the problem; the mistake may be just before it), "
              f"then run make check-{lesson} again.")
        return 1
    t0 = time.perf_counter()
    res = run(lesson, path, "learner", only)
    if res.errors:
        print("\n  The checks could not be collected:\n")
        print("\n".join("    " + ln for e in res.errors for ln in e.splitlines()[-15:]))
        return 1
    failed = 0
    uses = exercises_used(path, names)
    implemented = _implemented(path)
    for name in ([only] if only else names) + [n for n in res.checks if n not in names]:
        checks = res.checks.get(name, [])
        ok = sum(c.passed for c in checks)
        if not checks:
            failed += 1
            print(f"  ????  {name:<24} no check ran")
            continue
        if ok == len(checks):
            print(f"  PASS  {name:<24} {ok}/{len(checks)} checks")
            continue
        failed += 1
        bad = [c for c in checks if not c.passed]
        # a check of B fails because B calls the learner's own A, and A is wrong or still a stub: send them to A
        culprits = [(a, line) for a, line in uses.get(name, []) if not _passes(res, a, lesson, path)]
        if all(c.message.startswith("not implemented") for c in bad) and not (implemented.get(name) and culprits):
            print(f"  TODO  {name:<24} not implemented yet ({len(checks)} check{'s' * (len(checks) > 1)} waiting)")
            continue
        print(f"  FAIL  {name:<24} {ok}/{len(checks)} checks")
        for a, line in culprits:
            state = "is still a stub" if not implemented.get(a, True) else "fails its own checks"
            print(f"        ! your {name} calls your {a} (line {line}), which {state}: fix {a} first, "
                  f"this failure may be {a}'s")
        for c in bad:
            print(f"        x {c.test}")
            for line in c.message.splitlines():
                print(f"            {line}")
            if verbose:
                print("\n" + "\n".join("            | " + ln for ln in c.full.splitlines()) + "\n")
    total = len([only]) if only else len(names)
    print(f"\n{total - failed} of {total} exercises pass ({res.ran} checks ran in {time.perf_counter() - t0:.1f} s)."
          + (" Well done!" if failed == 0 and res.ran > 0 else ""))
    if failed:
        hint = f"make check-{lesson} EX=<name> VERBOSE=1"
        print(f"The checks are in tests/lessons/test_lesson_{lesson:02d}.py; for one exercise with full tracebacks: "
              f"{hint}")
    return 1 if failed or res.ran == 0 else 0


def exercises_used(path: Path, names: list[str]) -> dict[str, list[tuple[str, int]]]:
    """{exercise B: [(exercise A, line), ...]}: the other exercises B's definition in the learner's file names."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return {}
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            found = {}
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and sub.id in names and sub.id != node.name:
                    found.setdefault(sub.id, sub.lineno)
            out[node.name] = sorted(found.items(), key=lambda kv: kv[1])
    return out


def _implemented(path: Path) -> dict[str, bool]:
    from tinyserve.course import implemented_names
    try:
        return implemented_names(path)
    except (OSError, SyntaxError):
        return {}


def _passes(res: Results, name: str, lesson: int, path: Path) -> bool:
    """Does the learner's `name` pass its own checks? (Runs them if this report did not: make check-N EX=...)"""
    if name not in res.checks:
        res.checks[name] = run(lesson, path, "learner", name).checks.get(name, [])
    checks = res.checks[name]
    return bool(checks) and all(c.passed for c in checks)


# --- CI: stubs and kept wrong answers must fail ----------------------------------------------------------------

@contextlib.contextmanager
def committed_stub(lesson: int):
    """The exercises.py as committed (so a learner's solved copy cannot hide a check that cannot fail):
    yields its path, a temporary copy that is removed afterwards."""
    rel = (lesson_dir(lesson) / "exercises.py").relative_to(ROOT)
    try:
        text = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        yield ROOT / rel  # not a git checkout (or not committed yet): the file as it is
        return
    with tempfile.TemporaryDirectory(prefix="stub-") as tmp:
        path = Path(tmp) / "exercises.py"
        path.write_text(text)
        yield path


def prove_stubs_fail(lessons: list[int]) -> int:
    bad = []
    for lesson in lessons:
        with committed_stub(lesson) as stub:
            res = run(lesson, stub)
        bad += [f"lesson {lesson}: the checks did not load:\n{e}" for e in res.errors]
        passing = [f"{name}::{c.test}" for name, checks in res.checks.items() for c in checks if c.passed]
        if res.ran == 0:
            bad.append(f"lesson {lesson}: no exercise checks ran")
        missing = [n for n in exercise_names(lesson) if n not in res.checks]
        bad += [f"lesson {lesson}: exercise {n} has no check (mark one @pytest.mark.exercise({n!r}))" for n in missing]
        bad += [f"lesson {lesson}: {t} passes on the untouched stub (it cannot fail)" for t in passing]
        print(f"lesson {lesson}: {res.ran - len(passing)} of {res.ran} exercise checks fail on the untouched stubs, "
              "as they must")
    for line in bad:
        print("ERROR:", line)
    return 1 if bad else 0


@dataclass(frozen=True)
class WrongAnswer:
    path: Path
    mistake: str        # the docstring's first line
    caught_by: str      # the exercise whose checks must fail on it


def wrong_answers(lesson: int) -> list[WrongAnswer]:
    out = []
    for path in sorted((WRONG / f"lesson_{lesson:02d}").glob("*.py")):
        tree = ast.parse(path.read_text())
        doc = (ast.get_docstring(tree) or "").strip().splitlines()
        caught = next((ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == "CAUGHT_BY" for t in n.targets)), None)
        if not doc or not caught:
            raise SystemExit(f"{_rel(path)}: a wrong answer needs a docstring (the mistake) and CAUGHT_BY = 'exercise'")
        out.append(WrongAnswer(path, doc[0], caught))
    return out


def prove_wrong_answers_fail(lessons: list[int]) -> int:
    bad, total = [], 0
    t0 = time.perf_counter()
    for lesson in lessons:
        kept = wrong_answers(lesson)
        names = exercise_names(lesson)
        for w in kept:
            total += 1
            if w.caught_by not in names:
                bad.append(f"{_rel(w.path)}: CAUGHT_BY {w.caught_by!r} is not an exercise of lesson {lesson}")
                continue
            res = run(lesson, w.path, "patch", only=w.caught_by, stop_at_first=True)
            failing = [c for c in res.checks.get(w.caught_by, []) if not c.passed]
            if res.errors or res.ran == 0:
                bad.append(f"{_rel(w.path)}: its checks did not run" + "".join(f"\n{e}" for e in res.errors))
            elif not failing:
                bad.append(f"{_rel(w.path)}: passes every {w.caught_by} check, but it is wrong: {w.mistake}")
            else:
                first = failing[0]
                why = first.message.splitlines()[0] if first.message else ""
                print(f"  caught  lesson {lesson} {w.path.stem:<42} by {first.test}: {why[:90]}")
        print(f"lesson {lesson}: {len(kept)} kept wrong answers")
    print(f"{total - len(bad)} of {total} wrong answers are caught ({time.perf_counter() - t0:.0f} s)")
    for line in bad:
        print("ERROR:", line)
    return 1 if bad else 0


def main() -> int:
    # the checks compare your functions with the reference: the learner switch must not swap the reference too
    os.environ.pop("TINYSERVE_SOLUTION", None)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("lesson", help="lesson number, or 'all'")
    p.add_argument("--ex", default=None, help="run one exercise only (its name, as in the report)")
    p.add_argument("-v", "--verbose", action="store_true", help="print the full traceback of every failing check")
    p.add_argument("--stubs-must-fail", action="store_true")
    p.add_argument("--wrong-answers-must-fail", action="store_true")
    args = p.parse_args()
    have = lessons_with_tests()
    if args.lesson != "all" and (not args.lesson.isdigit() or int(args.lesson) not in have):
        print(f"no self-checks for lesson {args.lesson!r}: tests/lessons/test_lesson_NN.py exist for lessons {have}")
        return 2
    lessons = have if args.lesson == "all" else [int(args.lesson)]
    if args.stubs_must_fail:
        return prove_stubs_fail(lessons)
    if args.wrong_answers_must_fail:
        return prove_wrong_answers_fail(lessons)
    return max(report_learner(n, args.ex or None, args.verbose) for n in lessons)


if __name__ == "__main__":
    sys.exit(main())
