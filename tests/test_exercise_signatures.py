"""Every exercise stub matches its reference function: same parameters, in order, with the same defaults.

Discovers tests/lessons/test_lesson_*.py on its own, reads each file's REFERENCE table (without importing the
test module), and checks lessons/NN_*/exercises.py against it, so a lesson added later is covered without
touching this file. It reads the stubs from the working tree, whatever TINYSERVE_IMPL says.
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from tests.lessons.impl import _import_path, lesson_dir, resolve

LESSON_TESTS = Path(__file__).resolve().parent / "lessons"


def reference_table(test_file: Path) -> dict[str, str]:
    """The literal `REFERENCE = {...}` of a lesson's test file."""
    for node in ast.parse(test_file.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REFERENCE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{test_file.name} has no module-level REFERENCE = {{...}} table")


def _cases() -> list:
    cases = []
    for test_file in sorted(LESSON_TESTS.glob("test_lesson_*.py")):
        lesson = int(test_file.stem.split("_")[-1])
        for name, target in reference_table(test_file).items():
            cases.append(pytest.param(lesson, name, target, id=f"lesson{lesson:02d}-{name}"))
    return cases


def _params(fn) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_every_lesson_test_file_is_discovered():
    assert _cases(), "no tests/lessons/test_lesson_*.py with a REFERENCE table found"


@pytest.mark.parametrize("lesson,name,target", _cases())
def test_stub_signature_matches_reference(lesson: int, name: str, target: str):
    path = lesson_dir(lesson) / "exercises.py"
    assert path.exists(), f"lesson {lesson}: {path} is missing"
    stubs = _import_path(path, f"exercises_{lesson:02d}_signature_check")
    stub = getattr(stubs, name, None)
    assert callable(stub), f"{path.name} has no function {name}() (REFERENCE maps it to {target})"
    # a stub that re-exports the reference would make every check pass without the learner writing anything
    # (a class exercise: ask its __init__, since a class's source file is looked up through sys.modules)
    assert inspect.getsourcefile(stub.__init__ if inspect.isclass(stub) else stub) == str(path), \
        f"{name} in {path.name} must be defined there, not imported"
    assert inspect.getdoc(stub), f"{name} in {path.name} needs a docstring (shapes and what it computes)"
    reference = resolve(target)
    assert _params(stub) == _params(reference), (
        f"{path.name}:{name}{inspect.signature(stub)} differs from {target}{inspect.signature(reference)}")
