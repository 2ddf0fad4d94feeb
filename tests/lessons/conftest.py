"""Say whose code the lesson self-checks test: plain `pytest` checks the reference, not your exercises.py."""
from __future__ import annotations

import os

from tests.lessons.impl import impl_mode


def pytest_report_header(config):
    mode = impl_mode()
    if os.environ.get("TINYSERVE_SOLUTION"):
        return (f"TINYSERVE_SOLUTION={os.environ['TINYSERVE_SOLUTION']}: tinyserve runs YOUR exercise functions in "
                f"place of the reference, so the reference tests test your code (unset it to test the reference)")
    if mode == "reference":
        return ("lesson self-checks: testing the REFERENCE (tinyserve/*.py), not your exercises. To check yours: "
                "make check-N, or TINYSERVE_IMPL=learner pytest tests/lessons/test_lesson_NN.py")
    where = os.environ.get("TINYSERVE_EXERCISES_FILE") or "lessons/NN_*/exercises.py"
    return f"lesson self-checks: testing {where} (TINYSERVE_IMPL={mode})"
