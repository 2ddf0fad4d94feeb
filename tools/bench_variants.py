"""Tokens/s of every kernel variant this CPU runs (kernels/isa.py), side by side: `make bench-variants`.

A variant is chosen once per process, so each round starts one process per variant (and one for the float32 NumPy
reference), one after the other: round r measures every variant before round r + 1 starts, and the table shows the
median over rounds and its spread. A forced variant below the CPU's own runs its instructions at this CPU's clock:
it says what those instructions cost, not what an AVX2 laptop reaches.

    .venv/bin/python tools/bench_variants.py --rounds 3 [--variants avx512vnni,avx2] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUANTS = ["int8", "w8a8", "w8a8-64", "w4a8"]  # the Numba modes measured per variant (quant.QUANT_MODES)
NAMES = {"int8": "int8", "w8a8": "W8A8", "w8a8-64": "W8A8-64", "w4a8": "W4A8"}

WORKER = """
import json, sys
import tinyserve as ts
from tinyserve import speed
from tinyserve.kernels import isa, single_thread_blas
cells = json.loads(sys.argv[1])
out = {"kernels": isa.describe()}
for quant, backend in cells["modes"]:
    model = ts.load_model(quant=quant, backend=backend)
    speed.decode_tokens_per_s(model, 1, new_tokens=4)             # compile / load the kernels and warm up
    speed.prefill_tokens_per_s(model, 64)
    for b in cells["batches"]:
        out[f"{quant}/decode B={b}"] = speed.decode_tokens_per_s(model, b, new_tokens=cells["new_tokens"])
    for n in cells["prefills"]:
        out[f"{quant}/prefill {n}"] = speed.prefill_tokens_per_s(model, n)
print("RESULT " + json.dumps(out))
"""


def measure(variant: str | None, modes, args) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TINYSERVE_PORTABLE_KERNELS", None)
    if variant:
        env["TINYSERVE_KERNELS"] = variant
    cells = {"modes": modes, "batches": args.batches, "prefills": args.prefills, "new_tokens": args.new_tokens}
    r = subprocess.run([sys.executable, "-c", WORKER, json.dumps(cells)], env=env, capture_output=True, text=True,
                       cwd=ROOT, timeout=3600)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"variant {variant}: failed\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from tinyserve.kernels import isa
    from tinyserve.measure import Spread, cpu_name, format_table
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(isa.supported()), help="comma-separated (default: every one "
                   "this CPU runs)")
    p.add_argument("--quick", action="store_true", help="1 round, B=1 and prefill 128 only")
    args = p.parse_args()
    args.batches, args.prefills, args.new_tokens = ([1], [128], 8) if args.quick else ([1, 16], [512], 32)
    rounds = 1 if args.quick else args.rounds
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in isa.supported():
            raise SystemExit(f"this CPU cannot run {v!r} (it runs {', '.join(isa.supported())})")
    print(f"CPU: {cpu_name()}; variants: {', '.join(variants)}; {rounds} round(s), interleaved")
    runs: dict[str, list[dict]] = {v: [] for v in ["fp32"] + variants}
    for r in range(rounds):
        for v in runs:
            modes = [["none", "numpy"]] if v == "fp32" else [[q, "numba"] for q in QUANTS]
            res = measure(None if v == "fp32" else v, modes, args)
            runs[v].append(res)
            print(f"  round {r + 1}/{rounds}: {v:<11} done ({res['kernels']})", flush=True)
    cells = [f"decode B={b}" for b in args.batches] + [f"prefill {n}" for n in args.prefills]
    print("\ntokens/s, median (min-max) of the rounds; ratio = median of the per-round ratios to fp32 NumPy\n")
    rows = [["variant / mode", *cells]]
    for v, results in runs.items():
        for quant in (["none"] if v == "fp32" else QUANTS):
            row = ["fp32 NumPy (BLAS)" if v == "fp32" else f"{v} {NAMES[quant]}"]
            for c in cells:
                xs = [res[f"{quant}/{c}"] for res in results]
                ratios = [x / f[f"none/{c}"] for x, f in zip(xs, runs["fp32"])]
                row.append(f"{Spread.of(xs).fmt(1)} {Spread.of(ratios).median:4.2f}x")
            rows.append(row)
    print(format_table(rows, markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
