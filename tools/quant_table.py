"""W8A8's accuracy against its speed, one table (lesson 7, "outliers"; `make bench-quant`).

For float32, int8 (W8A32), W8A8 with one activation scale per token, W8A8 after SmoothQuant (quant.smooth_model,
calibrated on the shipped calibration text), W8A8-64 (one activation scale per 64 inputs) and W4A8 (the GGUF's own
Q4_1 weights, int8 activations per 32):
- accuracy, teacher-forced against float32 on the reference-fixture prompts (top-1 agreement, max |dlogit|) and
  perplexity on the shipped evaluation text (tests/quant_accuracy.py: the measurements tests/test_quant_accuracy.py
  pins), on the Numba kernels;
- speed: decode tokens/s at B=1 and B=16 and prefill 512 tokens/s (tinyserve.speed), every mode measured once per
  round, rounds interleaved; the median and min-max of the rounds (tinyserve.measure.Spread).

    .venv/bin/python tools/quant_table.py [--rounds 3] [--no-speed]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROWS = [  # (row name, quant mode, smoothed?)
    ("float32 (NumPy)", "none", False),
    ("int8 (W8A32)", "int8", False),
    ("W8A8, per token", "w8a8", False),
    ("W8A8, SmoothQuant", "w8a8", True),
    ("W8A8-64", "w8a8-64", False),
    ("W4A8 (Q4_1 weights)", "w4a8", False),
]


def build(base, smoothed_base, mode, smoothed):
    from tinyserve import backend, quant
    if mode == "none":
        return base
    return backend.set_backend(quant.quantize_model(smoothed_base if smoothed else base, mode), mode, "numba")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args()
    import tinyserve as ts
    from tinyserve import quant, speed
    from tinyserve.kernels import isa
    from tinyserve.measure import Spread, format_table
    from tinyserve.tokenizer import load_tokenizer
    from tests.quant_accuracy import agreement, fp32_logits, perplexity, perplexity_ids
    cpu = speed.cpu_name()
    print(f"CPU: {cpu}; {isa.describe()}", flush=True)
    base, tok = ts.load_model(), load_tokenizer()
    t = time.perf_counter()
    smoothed_base = quant.smooth_model(base, quant.activation_maxima(base, quant.calibration_ids(tok)))
    print(f"SmoothQuant calibration: {time.perf_counter() - t:.1f} s", flush=True)
    models = {name: build(base, smoothed_base, mode, sm) for name, mode, sm in ROWS}
    ref, ids = fp32_logits(base), perplexity_ids(tok)
    acc = {}
    for name, m in models.items():
        a, ppl = agreement(m, ref), perplexity(m, ids)
        acc[name] = (a, ppl)
        print(f"  accuracy: {name:<20} top-1 {a.top1:.1%}  max|dlogit| {a.max_logit_err:.2f}  perplexity {ppl:.3f}",
              flush=True)
    cells = ["decode B=1", "decode B=16", "prefill 512"]
    speeds = {(n, c): [] for n in models for c in cells}
    if not args.no_speed:
        for m in models.values():                                     # compile and warm up every path first
            speed.decode_tokens_per_s(m, 1, new_tokens=4), speed.prefill_tokens_per_s(m, 64)
        for r in range(args.rounds):
            for name, m in models.items():
                speeds[name, cells[0]].append(speed.decode_tokens_per_s(m, 1))
                speeds[name, cells[1]].append(speed.decode_tokens_per_s(m, 16))
                speeds[name, cells[2]].append(speed.prefill_tokens_per_s(m, 512))
            print(f"  speed: round {r + 1}/{args.rounds} done", flush=True)
    p0 = acc[ROWS[0][0]][1]
    print(f"\n{cpu}, {isa.describe()}; tokens/s median (min-max) of {args.rounds} interleaved rounds\n")
    rows = [["mode", "top-1 vs float32", "max \\|dlogit\\|", "perplexity (ratio)", *cells]]
    for name, _, _ in ROWS:
        a, ppl = acc[name]
        sp = [Spread.of(speeds[name, c]).fmt(0) if speeds[name, c] else "-" for c in cells]
        rows.append([name, f"{a.top1:.1%}", f"{a.max_logit_err:.2f}", f"{ppl:.3f} ({ppl / p0:.4f})", *sp])
    print(format_table(rows, markdown=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
