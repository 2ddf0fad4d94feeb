#!/usr/bin/env python
"""Self-checks for the lesson exercises.

    python tools/check.py 1                 # `make check-1`: lesson 1's tests against your exercises.py
    python tools/check.py --stubs-must-fail all
        # part of `make test`: every exercise test must FAIL on the untouched stubs (as committed in git),
        # because a check that cannot fail teaches nothing. (The same tests pass on the reference: pytest.)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.lessons.impl import lesson_dir  # noqa: E402


def lessons_with_tests() -> list[int]:
    return sorted(int(p.stem.split("_")[-1]) for p in (ROOT / "tests" / "lessons").glob("test_lesson_*.py"))


class Collector:
    """A pytest plugin that remembers, per exercise, which checks passed and the first failure message."""

    def __init__(self):
        self.results: dict[str, list[tuple[str, bool, str]]] = defaultdict(list)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if report.when == "call" or (report.when == "setup" and report.failed):
            marker = item.get_closest_marker("exercise")
            name = marker.args[0] if marker else "(not an exercise)"
            message = ""
            if report.failed:
                message = _short(call.excinfo)
            self.results[name].append((item.name, report.passed, message))


def _short(excinfo) -> str:
    if excinfo is None:
        return ""
    if excinfo.errisinstance(NotImplementedError):
        return "not implemented yet (still the stub)"
    text = str(excinfo.value).strip().splitlines()
    return f"{excinfo.typename}: {text[0][:160] if text else ''}"


def run(lesson: int, exercises: Path | None) -> Collector:
    env_backup = dict(os.environ)
    os.environ["TINYSERVE_IMPL"] = "learner"
    if exercises is not None:
        os.environ["TINYSERVE_EXERCISES_FILE"] = str(exercises)
    collector = Collector()
    try:
        pytest.main(["-q", "-p", "no:cacheprovider", "--no-header", "-p", "no:warnings", "--tb=no",
                     "-o", "addopts=", str(ROOT / "tests" / "lessons" / f"test_lesson_{lesson:02d}.py")],
                    plugins=[collector])
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    return collector


@contextlib.contextmanager
def committed_stub(lesson: int):
    """The exercises.py as committed (so a learner's solved copy cannot hide a check that cannot fail):
    yields its path, a temporary copy that is removed afterwards."""
    rel = (lesson_dir(lesson) / "exercises.py").relative_to(ROOT)
    try:
        text = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError):
        yield ROOT / rel  # not a git checkout: the file as it is
        return
    with tempfile.TemporaryDirectory(prefix="stub-") as tmp:
        path = Path(tmp) / "exercises.py"
        path.write_text(text)
        yield path


def report_learner(lesson: int) -> int:
    path = lesson_dir(lesson) / "exercises.py"
    print(f"\nLesson {lesson} self-check: {path.relative_to(ROOT)}\n")
    results = run(lesson, None).results
    failed = 0
    for name, checks in results.items():
        ok = sum(p for _, p, _ in checks)
        if ok == len(checks):
            print(f"  PASS  {name:<28} {ok}/{len(checks)} checks")
        else:
            failed += 1
            first = next(m for _, p, m in checks if not p)
            print(f"  FAIL  {name:<28} {ok}/{len(checks)} checks  -> {first}")
            for test, p, _ in checks:
                if not p:
                    print(f"          - {test}")
    total = len(results)
    print(f"\n{total - failed} of {total} exercises pass." + ("" if failed else " Well done!"))
    if failed:
        print(f"Look at the failing checks in tests/lessons/test_lesson_{lesson:02d}.py to see what is expected.")
    return 1 if failed or not results else 0


def prove_stubs_fail(lessons: list[int]) -> int:
    bad = []
    for lesson in lessons:
        with committed_stub(lesson) as stub:
            results = run(lesson, stub).results
        n = sum(len(c) for c in results.values())
        passing = [f"{name}::{test}" for name, checks in results.items() for test, p, _ in checks if p]
        if n == 0:
            bad.append(f"lesson {lesson}: no exercise tests ran")
        bad += [f"lesson {lesson}: {t} passes on the untouched stub (it cannot fail)" for t in passing]
        print(f"lesson {lesson}: {n - len(passing)} of {n} exercise checks fail on the untouched stubs, as they must")
    for line in bad:
        print("ERROR:", line)
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("lesson", help="lesson number, or 'all'")
    p.add_argument("--stubs-must-fail", action="store_true")
    args = p.parse_args()
    lessons = lessons_with_tests() if args.lesson == "all" else [int(args.lesson)]
    if args.stubs_must_fail:
        return prove_stubs_fail(lessons)
    return max(report_learner(n) for n in lessons)


if __name__ == "__main__":
    sys.exit(main())
