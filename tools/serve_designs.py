#!/usr/bin/env python
"""Lesson 8's comparison at full size: the three orchestrator designs on SmolLM2 under one seeded Poisson trace at
several rates (the notebook runs a smaller version). Prints a table and writes build/serve_designs.json.

    python tools/serve_designs.py --rates 0.5,1,2 --requests 24 --quant int8 --backend numba
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tinyserve.orchestrators import ModelSpec, compare_designs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--prompt-len", default="16:128")
    p.add_argument("--output-len", default="8:48")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    p.add_argument("--backend", default=None, help="numpy | numba (load_model and the engines)")
    p.add_argument("--quant", default=None, help="e.g. int8 (load_model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "build" / "serve_designs.json"))
    p.add_argument("--max-seconds", type=float, default=None,
                   help="wall-time cap: no new rate starts after this many seconds (a busy machine stretches every run)")
    a = p.parse_args()
    if a.max_seconds is not None and a.max_seconds <= 0:
        p.error(f"--max-seconds must be positive, got {a.max_seconds}")
    lo_hi = lambda s: tuple(int(x) for x in s.split(":"))  # noqa: E731
    rates, rows, start = [float(r) for r in a.rates.split(",")], [], time.perf_counter()
    for i, rate in enumerate(rates):          # one rate at a time, so the cap can stop between them
        if a.max_seconds is not None and time.perf_counter() - start > a.max_seconds:
            print(f"stopped after {time.perf_counter() - start:.0f} s (--max-seconds {a.max_seconds:g}): the machine "
                  f"was too busy for rates {rates[i:]}")
            break
        rows += compare_designs(ModelSpec(a.model, quant=a.quant, backend=a.backend), [rate], a.requests,
                                lo_hi(a.prompt_len), lo_hi(a.output_len), seed=a.seed,
                                engine_kw={"backend": a.backend} if a.backend else {}, progress=print)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
