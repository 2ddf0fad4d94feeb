"""One test body, two implementations.

Each lesson's self-check tests call `load_impl(N, REFERENCE)` and test whatever it returns:
  - TINYSERVE_IMPL=reference (default): the functions of the tinyserve modules named in REFERENCE;
  - TINYSERVE_IMPL=learner: the same names from lessons/NN_*/exercises.py (or from TINYSERVE_EXERCISES_FILE),
    which is what `make check-N` runs.
So the exercise tests and the engine's own tests can never drift apart.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


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
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resolve(target: str):
    """'tinyserve.layers:rms_norm' -> the function."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def load_impl(lesson: int, reference: dict[str, str]) -> SimpleNamespace:
    mode = os.environ.get("TINYSERVE_IMPL", "reference")
    if mode == "reference":
        return SimpleNamespace(**{name: resolve(target) for name, target in reference.items()}, mode=mode)
    if mode != "learner":
        raise ValueError(f"TINYSERVE_IMPL must be 'reference' or 'learner', got {mode!r}")
    module = _import_path(exercises_file(lesson), f"exercises_{lesson:02d}")
    missing = [n for n in reference if not hasattr(module, n)]
    if missing:
        raise AttributeError(f"{exercises_file(lesson)} lacks {missing}")
    return SimpleNamespace(**{name: getattr(module, name) for name in reference}, mode=mode)
