"""Small helpers the lesson notebooks share: where to put figures, and a findings ledger.

`make lesson-N` runs a notebook with TINYSERVE_BUILD=build/lesson-NN; the notebook saves its figures there and
records its findings (each a number with the conditions it was measured under), which the runner prints.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Callable

_ROOT = Path(__file__).resolve().parent.parent


def build_dir(lesson: int | None = None) -> Path:
    d = Path(os.environ.get("TINYSERVE_BUILD", _ROOT / "build" / (f"lesson-{lesson:02d}" if lesson else "scratch")))
    d.mkdir(parents=True, exist_ok=True)
    return d


def savefig(fig, name: str, lesson: int | None = None) -> Path:
    path = build_dir(lesson) / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def record(finding: str, lesson: int | None = None, **numbers) -> None:
    """Append one finding (a sentence plus the numbers behind it) to build/lesson-NN/findings.jsonl."""
    with open(build_dir(lesson) / "findings.jsonl", "a") as f:
        f.write(json.dumps({"finding": finding, **numbers}) + "\n")
    print(finding)


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds, after `warmup` untimed calls (machines here are shared and noisy)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
