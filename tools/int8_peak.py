"""The int8 multiply-add peak of this CPU, measured: what a prefill's int8 GEMMs could reach at best.

    .venv/bin/python tools/int8_peak.py                  # the kernels' variant (kernels/isa.py), 2 threads
    .venv/bin/python tools/int8_peak.py --variant avx2 --threads 1

How it is measured: tools/int8_peak.c, compiled here once with the system's C compiler (`cc -O3 -march=native
-fopenmp`, cached under build/int8_peak/ by the source's hash), runs on `threads` OpenMP threads the instruction
sequence tinyserve's int8 kernels use for the variant (kernels/int8_dot.py: vpdpbusd zmm on avx512vnni, vpdpbusd
ymm on avxvnni, vpmaddubsw + vpmaddwd + vpaddd on avx2, sdot on neon) on twelve independent accumulators in
registers: no load, no store, nothing but the multiply-adds. It counts the products (one u8 x s8 product is one
multiply-add) per second of wall time, the best of `repeat` runs. A real GEMM also loads, broadcasts, converts and
stores, so no kernel reaches this number: it is a ceiling, not a target.

bench-peers (tools/bench_peers.py) measures it every round and gives tinyserve's prefill as a share of it: the
multiply-adds of the layers' matrices for the prompt (model_macs_per_token x tokens) over the seconds, over the peak.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "tools" / "int8_peak.c"
VARIANTS = ("avx512vnni", "avxvnni", "avx2", "neon")     # the kernels' variants that have an int8 dot instruction


class PeakError(RuntimeError):
    """No compiler, no kernel for this variant, or the program failed: the message says which."""


@dataclass(frozen=True, slots=True)
class Peak:
    variant: str
    threads: int
    macs_per_s: float           # u8 x s8 products a second, all threads together
    macs_per_instruction: int


def compiler() -> str | None:
    """$CC, else the first of cc, gcc, clang on PATH."""
    if cc := os.environ.get("CC"):
        return cc
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def build(out_dir: Path = ROOT / "build" / "int8_peak") -> Path:
    """Compile int8_peak.c for this CPU once (a binary per source hash and compiler); its path."""
    cc = compiler()
    if cc is None:
        raise PeakError("int8 peak: no C compiler (cc, gcc or clang; or set CC) to build tools/int8_peak.c")
    digest = hashlib.sha256(SOURCE.read_bytes() + cc.encode()).hexdigest()[:12]
    exe = out_dir / f"int8_peak-{digest}"
    if exe.is_file():
        return exe
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = exe.with_suffix(".tmp")
    cmd = [cc, "-O3", "-march=native", "-fopenmp", str(SOURCE), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        first = (done.stderr.strip().splitlines() or ["no message"])[0]
        raise PeakError(f"int8 peak: `{' '.join(cmd)}` failed: {first}")
    tmp.replace(exe)
    return exe


def parse(line: str) -> Peak:
    """The program's one JSON line -> Peak."""
    try:
        d = json.loads(line)
        return Peak(d["variant"], int(d["threads"]), float(d["macs_per_s"]), int(d["macs_per_instruction"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise PeakError(f"int8 peak: the program printed {line.strip()[:120]!r}, not its JSON line ({e})") from None


def measure(variant: str, threads: int, steps: int = 400_000, repeat: int = 5) -> Peak:
    """The best of `repeat` runs of `steps` x 64 x 12 instructions on each of `threads` threads."""
    if variant not in VARIANTS:
        raise PeakError(f"int8 peak: no int8 dot-product instruction for the {variant!r} kernels; "
                        f"choose from {', '.join(VARIANTS)}")
    exe = build()
    done = subprocess.run([str(exe), variant, str(threads), str(steps), str(repeat)], capture_output=True, text=True)
    if done.returncode != 0:
        raise PeakError((done.stderr.strip().splitlines() or [f"int8 peak: exit {done.returncode}"])[0])
    return parse(done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "")


def model_macs_per_token(config) -> int:
    """Multiply-adds of one token through the layers' matrices (Q, K, V, O, gate, up, down): the int8 GEMMs of a
    prefill. Attention's scores and the LM head are left out (the LM head runs on the last row only)."""
    D, F, L = config.dim, config.intermediate_size, config.n_layers
    q = config.n_heads * config.head_dim
    kv = config.n_kv_heads * config.head_dim
    return L * (D * q + 2 * D * kv + q * D + 3 * D * F)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", default=None, help=f"one of {', '.join(VARIANTS)} (default: the kernels' own)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    if args.threads < 1 or args.repeat < 1:
        ap.error("--threads and --repeat must be >= 1")
    variant = args.variant
    if variant is None:
        sys.path.insert(0, str(ROOT))
        from tinyserve.kernels import isa
        variant = isa.NAME
    try:
        p = measure(variant, args.threads, repeat=args.repeat)
    except PeakError as e:
        print(e, file=sys.stderr)
        return 2
    print(f"int8 peak ({p.variant}, {p.macs_per_instruction} multiply-adds an instruction, {p.threads} thread(s)): "
          f"{p.macs_per_s / 1e9:.0f} G multiply-adds/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
