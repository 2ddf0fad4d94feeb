"""Time the Engine's decode step at batch 1 and 16 on the default path, for an A/B of two trees.

    PYTHONPATH=<tree> python tools/ab_decode.py [--weights DIR] [--steps N]     # prints one JSON line

Each batch: prefill the prompts, a few warm-up steps, then N decode steps timed one by one; the median step time.
Run it alternately on the two trees (`--pairs` does that from one command) and compare medians: the machine is
shared, so only interleaved runs say anything. `--cpu` runs the step on one thread and times it by the process's CPU
time: on a machine whose cores other programs keep busy, the wall clock of a step whose threads meet at barriers
measures the other programs; one thread's CPU time measures the code.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def measure(weights: str, steps: int, cpu: bool) -> dict:
    from tinyserve.engine import Engine
    from tinyserve.sampling import SamplingParams
    from tinyserve.weights import load_model

    model = load_model(weights, quant="auto", backend="numba")
    out = {"quant": model.quant}
    for batch in (1, 16):
        engine = Engine(model, num_blocks=512, block_size=16, max_batch_tokens=4096)
        params = SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True)
        for b in range(batch):
            engine.add_request([1 + (7 * b + j) % 4000 for j in range(64)], params)
        for _ in range(4):                 # the prefill and warm-up decode steps
            engine.step()
        clock = time.process_time if cpu else time.perf_counter
        times = []
        for _ in range(steps):
            t = clock()
            engine.step()
            times.append(clock() - t)
        out[f"b{batch}_ms"] = statistics.median(times) * 1e3
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--weights", default="weights/smollm2-135m-instruct")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--pairs", type=int, default=0, help="run A/B pairs: --a TREE --b TREE, alternating")
    p.add_argument("--a")
    p.add_argument("--b")
    p.add_argument("--cpu", action="store_true", help="one thread, timed by CPU time (see the docstring)")
    args = p.parse_args()
    if not args.pairs:
        print(json.dumps(measure(args.weights, args.steps, args.cpu)))
        return 0
    runs = {"a": [], "b": []}
    for i in range(args.pairs):
        for side in ("a", "b") if i % 2 == 0 else ("b", "a"):      # ABBA: neither side always goes first
            tree = getattr(args, side)
            env = dict(os.environ, PYTHONPATH=tree, NUMBA_CACHE_DIR=f"{tree}/.numba_cache")
            if args.cpu:
                env["NUMBA_NUM_THREADS"] = "1"
            r = subprocess.run([sys.executable, __file__, "--weights", args.weights, "--steps", str(args.steps)]
                               + (["--cpu"] if args.cpu else []), env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(side, runs[side][-1], flush=True)
    for key in ("b1_ms", "b16_ms"):
        a = statistics.median(r[key] for r in runs["a"])
        b = statistics.median(r[key] for r in runs["b"])
        print(f"{key}: a {a:.2f}  b {b:.2f}  b/a {b / a:.3f}   per pair b/a: "
              f"{[round(y[key] / x[key], 3) for x, y in zip(runs['a'], runs['b'])]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
