"""Deterministic verdicts: every property check of the lessons draws the same examples on every run and
keeps no example database, so `make check-N` gives the same verdict for the same file, whatever ran before."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from hypothesis import is_hypothesis_test

LESSONS = sorted(int(p.stem[-2:]) for p in Path(__file__).parent.glob("test_lesson_[0-9][0-9].py"))


@pytest.mark.parametrize("lesson", LESSONS)
def test_every_property_check_is_derandomised_without_a_database(lesson):
    module = importlib.import_module(f"tests.lessons.test_lesson_{lesson:02d}")
    props = {name: fn for name, fn in vars(module).items() if callable(fn) and is_hypothesis_test(fn)}
    assert len(props) == Path(module.__file__).read_text().count("\n@given("), "every @given test was found"
    for name, fn in props.items():
        s = fn._hypothesis_internal_use_settings
        assert s.derandomize and s.database is None, (
            f"{name}: decorate it with @settings(CHECKS, ...) (tests/lessons/impl.py): a lesson check must draw the "
            "same examples on every run and keep no example database")
