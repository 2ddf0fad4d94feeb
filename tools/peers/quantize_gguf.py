"""llama.cpp's own quantizer: the shipped Q4_1 GGUF rewritten in llama.cpp's other formats (Q4_0, IQ4_NL, Q8_0).

    .venv-llama/bin/python tools/peers/quantize_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf Q4_0 IQ4_NL Q8_0

Why: on x86, llama.cpp's CPU backend repacks Q4_0 and IQ4_NL into interleaved blocks at load time and runs them
with its fastest GEMV/GEMM kernels, and its tinyBLAS prefill covers Q4_0, IQ4_NL and Q8_0; Q4_1, the format the
model ships in, gets neither. A user who wants llama.cpp fast converts once, as this does; bench-peers then races
every format and compares tinyserve with the fastest one per workload.

The weights are then Q4_1's values requantized (`allow_requantize`), not quantized from the original float16
checkpoint (no offline copy of it exists here): a little less accurate than a direct quantization, exactly as
fast. Writes `<stem minus .Q4_1>.<FORMAT>.gguf` beside the input, once (an existing file is kept).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

FORMATS = ("Q4_0", "IQ4_NL", "Q8_0")


def output_path(src: Path, fmt: str) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.Q4_0.gguf (beside it)."""
    stem = src.name.removesuffix(".gguf")
    base = stem.rsplit(".", 1)[0] if "." in stem else stem
    return src.with_name(f"{base}.{fmt}.gguf")


def quantize(src: Path, fmt: str, threads: int = 2) -> Path:
    from llama_cpp import llama_cpp as C

    out = output_path(src, fmt)
    if out.exists() and out.stat().st_size > 0:
        return out
    ftype = getattr(C, f"LLAMA_FTYPE_MOSTLY_{fmt}", None)
    if ftype is None:
        raise SystemExit(f"quantize_gguf: llama.cpp has no format {fmt!r}")
    p = C.llama_model_quantize_default_params()
    p.nthread, p.ftype, p.allow_requantize = threads, ftype, True
    tmp = out.with_suffix(".tmp")
    t0 = time.perf_counter()
    rc = C.llama_model_quantize(str(src).encode(), str(tmp).encode(), p)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"quantize_gguf: llama_model_quantize({fmt}) returned {rc}")
    tmp.replace(out)
    print(f"quantize_gguf: {out.name}, {out.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f} s")
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    src, formats = Path(argv[0]), argv[1:] or list(FORMATS)
    if not src.is_file():
        print(f"quantize_gguf: no GGUF at {src}", file=sys.stderr)
        return 2
    for fmt in formats:
        quantize(src, fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
