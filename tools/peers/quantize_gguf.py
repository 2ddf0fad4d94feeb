"""The peers' own quantizers: the shipped Q4_1 GGUF rewritten in llama.cpp's other formats (Q4_0, IQ4_NL, Q8_0), and
in ik_llama.cpp's own (IQ4_KS).

    .venv-llama/bin/python tools/peers/quantize_gguf.py SmolLM2-135M-Instruct.Q4_1.gguf Q4_0 IQ4_NL Q8_0
    .venv-ik/bin/python tools/peers/quantize_gguf.py --ik SmolLM2-135M-Instruct.Q4_1.gguf IQ4_KS

Why: on x86, llama.cpp's CPU backend repacks Q4_0 and IQ4_NL into interleaved blocks at load time and runs them
with its fastest GEMV/GEMM kernels, and its tinyBLAS prefill covers Q4_0, IQ4_NL and Q8_0; Q4_1, the format the
model ships in, gets neither. A user who wants llama.cpp fast converts once, as this does; bench-peers then races
every format and compares tinyserve with the fastest one per workload.

The weights are then Q4_1's values requantized (`allow_requantize`), not quantized from the original float16
checkpoint (no offline copy of it exists here): a little less accurate than a direct quantization, exactly as
fast. Writes `<stem minus .Q4_1>.<FORMAT>.gguf` beside the input, once (an existing file is kept).

--ik runs the `llama-quantize` that ik-llama-cpp-python ships (ik_llama.cpp's, which knows its IQ*_K types) with
--allow-requantize. Its types are built from blocks of 256: a matrix whose rows are not a multiple of 256 (576 in
SmolLM2-135M) gets ik's fallback type instead, as llama.cpp's K-quants do; its log names each choice.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

FORMATS = ("Q4_0", "IQ4_NL", "Q8_0")
IK_FORMATS = ("IQ4_KS",)


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


def quantize_ik(src: Path, fmt: str, threads: int = 2) -> Path:
    """The same with ik_llama.cpp's llama-quantize binary (run in .venv-ik, where ik_llama_cpp is installed)."""
    from ik_worker import preload_ggml
    preload_ggml()                          # before the package loads its libllama.so
    import ik_llama_cpp

    out = output_path(src, fmt)
    if out.exists() and out.stat().st_size > 0:
        return out
    exe = ik_llama_cpp.find_quantize_bin()
    if exe is None:
        raise SystemExit("quantize_gguf: ik-llama-cpp-python has no llama-quantize binary (rebuild .venv-ik)")
    lib = Path(ik_llama_cpp.__file__).parent / "lib"        # its libllama.so and libggml.so
    paths = [str(lib), os.environ.get("LD_LIBRARY_PATH", "")]
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, paths))}
    tmp = out.with_suffix(".tmp")
    t0 = time.perf_counter()
    done = subprocess.run([str(exe), "--allow-requantize", str(src), str(tmp), fmt, str(threads)], env=env)
    if done.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"quantize_gguf: ik_llama.cpp's llama-quantize ({fmt}) exited with {done.returncode}")
    tmp.replace(out)
    print(f"quantize_gguf: {out.name}, {out.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.1f} s "
          f"(ik_llama.cpp's quantizer)")
    return out


def main(argv: list[str]) -> int:
    ik = bool(argv) and argv[0] == "--ik"
    argv = argv[1:] if ik else argv
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    src, formats = Path(argv[0]), argv[1:] or list(IK_FORMATS if ik else FORMATS)
    if not src.is_file():
        print(f"quantize_gguf: no GGUF at {src}", file=sys.stderr)
        return 2
    sys.stdout.flush()                   # the quantizer's own lines follow ours in a shared log
    for fmt in formats:
        (quantize_ik if ik else quantize)(src, fmt)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
