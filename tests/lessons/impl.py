"""One test body, two implementations.

Each lesson's self-check tests call `load_impl(N, REFERENCE)` and test whatever it returns:
  - TINYSERVE_IMPL=reference (the default, what plain `pytest` runs): the functions of the tinyserve modules
    named in REFERENCE;
  - TINYSERVE_IMPL=learner: the same names from lessons/NN_*/exercises.py (or from TINYSERVE_EXERCISES_FILE),
    which is what `make check-N` runs;
  - TINYSERVE_IMPL=patch: the names TINYSERVE_EXERCISES_FILE defines, the reference for the rest. The kept wrong
    answers (tests/lessons/wrong_answers/) are such patches: one mistake each over the reference.
So the exercise tests and the engine's own tests can never drift apart.

    TINYSERVE_IMPL=learner PYTHONPATH=. .venv/bin/python -m pytest tests/lessons/test_lesson_02.py -x
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parents[2]

# Every property check of the lessons draws its examples from this profile: the same examples on every run (derandomize)
# and no example database, so a file's verdict never depends on what an earlier run of anyone's code found.
# Use it as @settings(CHECKS, max_examples=...).
CHECKS = settings(derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODES = ("reference", "learner", "patch")


def lesson_dir(lesson: int) -> Path:
    found = sorted((ROOT / "lessons").glob(f"{lesson:02d}_*"))
    if not found:
        raise FileNotFoundError(f"no lessons/{lesson:02d}_* folder")
    return found[0]


def exercises_file(lesson: int) -> Path:
    override = os.environ.get("TINYSERVE_EXERCISES_FILE")
    return Path(override) if override else lesson_dir(lesson) / "exercises.py"


def _import_path(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module    # dataclasses and pickling look a module up by name while it executes
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def resolve(target: str):
    """'tinyserve.layers:rms_norm' -> the function."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def impl_mode() -> str:
    mode = os.environ.get("TINYSERVE_IMPL", "reference")
    if mode not in MODES:
        raise ValueError(f"TINYSERVE_IMPL must be one of {MODES}, got {mode!r}")
    return mode


def load_impl(lesson: int, reference: dict[str, str]) -> SimpleNamespace:
    mode = impl_mode()
    if mode == "reference":
        return SimpleNamespace(**{name: resolve(target) for name, target in reference.items()}, mode=mode)
    module = _import_path(exercises_file(lesson), f"exercises_{lesson:02d}")
    if mode == "patch":
        return SimpleNamespace(**{name: getattr(module, name) if hasattr(module, name) else resolve(target)
                                  for name, target in reference.items()}, mode=mode)
    missing = [n for n in reference if not hasattr(module, n)]
    if missing:
        raise AttributeError(f"{exercises_file(lesson)} lacks {missing}")
    return SimpleNamespace(**{name: getattr(module, name) for name in reference}, mode=mode)
