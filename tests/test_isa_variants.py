"""Every instruction-set variant of the kernels this CPU can run (kernels/isa.py), each proven the same way.

A variant is chosen once per process (TINYSERVE_KERNELS), so each runs in a process of its own, compiled for
exactly its features (an AVX-512 machine runs the avx2 tiles with AVX-512 switched off) and cached in its own
folder. What must hold on every variant:
- W8A8 matmuls (a scale per row, and per 64 activations), W4A8 ones (Q4_1 weights, a scale per 32), the byte
  tile's (quant "gguf": whole-byte weights, a scale and a minimum per 32), the nibble tile's without a minimum
  (Q4_0) and the 6-bit tile's (Q6_K's blocks) are
  bit-identical to the NumPy reference (integer sums; the tile's activation offset is undone exactly), at shapes
  that exercise full tiles, one-row tiles and ragged edges;
- W8A32 matmuls are within the stated tolerance of the reference, and bit-identical to this process's variant:
  a tile split into sub-tiles (AVX2's 16 registers) sums each output in the same order;
- the whole model (prefill kernels, the fused decode step, the LM head) gives the same logits and the same greedy
  tokens in every mode as this process's variant;
- the W4A8 tile compiles in seconds (LLVM 22 once hung on it for good: int4_dot's sign-bit xor).
Variants this CPU cannot run are skipped with the reason (an arm64 build never sees the x86 ones).
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from tinyserve.kernels import isa

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import tinyserve as ts
    from tinyserve import backend, kv_cache, naive, quant
    from tinyserve.kernels import isa
    from tinyserve.kernels.matmul import (block_sums, matmul_w4a8, matmul_w8a8, matmul_w8a32, pack_b8a8, pack_vnni,
                                          pack_q5a8, pack_q6a8, pack_s4a8, pack_s5a8, pack_s8a8, pack_w4a8, pack_w8a32,
                                          quantize_rows)
    from tinyserve.sampling import SamplingParams

    out = {"variant": np.array(isa.NAME)}
    rng = np.random.default_rng(3)
    for T, D, O in ((1, 64, 48), (4, 128, 64), (6, 128, 80), (9, 36, 16), (37, 96, 144), (5, 192, 32)):
        x = rng.standard_normal((T, D)).astype(np.float32)
        x[:, 0] *= 30                                                     # an outlier channel
        q = quant.quantize_weight(rng.standard_normal((D, O)).astype(np.float32), "w8a8")
        xu, sx = np.empty(x.shape, np.uint8), np.empty(T, np.float32)
        quantize_rows(x, xu, sx)
        out[f"w8a8_{T}_{D}_{O}"] = matmul_w8a8(xu, sx, pack_vnni(q.wq), q.wq.sum(axis=0, dtype=np.int32), q.scale)
        out[f"w8a8_ref_{T}_{D}_{O}"] = quant.matmul_reference(x, q)
        if D % 64 == 0:                                                  # w8a8-64: a scale per 64 activations
            nb = D // 64
            xu, sx = np.empty(x.shape, np.uint8), np.empty((T, nb), np.float32)
            quantize_rows(x, xu, sx)
            out[f"w8a8_b64_{T}_{D}_{O}"] = matmul_w8a8(xu, sx, pack_vnni(q.wq), block_sums(q.wq, nb), q.scale)
            out[f"w8a8_ref_b64_{T}_{D}_{O}"] = quant.matmul_reference(x, quant.QuantizedLinear(q.wq, q.scale,
                                                                                              "w8a8-64"))
        if D % 32 == 0:                                                  # w4a8: Q4_1 weights, a scale per 32
            q4 = quant.quantize_q4_1(rng.standard_normal((D, O)).astype(np.float32))
            xu, sx = np.empty(x.shape, np.uint8), np.empty((T, D // 32), np.float32)
            quantize_rows(x, xu, sx)
            out[f"w4a8_{T}_{D}_{O}"] = matmul_w4a8(xu, sx, pack_w4a8(q4.q, q4.d, q4.m))
            out[f"w4a8_ref_{T}_{D}_{O}"] = quant.matmul_reference_w4a8(x, q4)
            b8 = quant.quantize_q8_blocks(rng.standard_normal((D, O)).astype(np.float32))   # the byte tile
            b8.q[0] = 255                                                # the largest byte, against the outlier
            out[f"b8a8_{T}_{D}_{O}"] = matmul_w4a8(xu, sx, pack_b8a8(b8.q, b8.d, b8.m))
            out[f"b8a8_ref_{T}_{D}_{O}"] = quant.matmul_reference_w4a8(x, b8)
            d4 = (rng.random((D // 32, O)) * 0.1).astype(np.float16).astype(np.float32)   # Q4_0: m = -8 d
            s4 = quant.S4Linear(rng.integers(0, 16, (D, O)).astype(np.uint8), d4, np.float32(-8) * d4)
            out[f"s4a8_{T}_{D}_{O}"] = matmul_w4a8(xu, sx, pack_s4a8(s4.q, s4.d))   # the nibble tile without m
            out[f"s4a8_ref_{T}_{D}_{O}"] = quant.matmul_reference_w4a8(x, s4)
            out[f"s8a8_{T}_{D}_{O}"] = matmul_w4a8(xu, sx, pack_s8a8(b8.q, b8.d))   # bytes without m (-128 d)
            out[f"s8a8_ref_{T}_{D}_{O}"] = quant.matmul_reference_w4a8(x, b8)
            m5 = (-15.5 * d4).astype(np.float16).astype(np.float32)
            q5 = quant.Q5Linear(rng.integers(0, 32, (D, O)).astype(np.uint8), d4, m5)   # the 5-bit tile
            q5.q[0] = 31                                                 # the largest value, against the outlier
            out[f"q5a8_{T}_{D}_{O}"] = matmul_w4a8(xu, sx, pack_q5a8(q5.q, q5.d, q5.m))
            out[f"q5a8_ref_{T}_{D}_{O}"] = quant.matmul_reference_w4a8(x, q5)
            s5 = quant.S5Linear(q5.q, d4, np.float32(-16) * d4)          # Q5_0: m = -16 d, formed in the tile
            out[f"s5a8_{T}_{D}_{O}"] = matmul_w4a8(xu, sx, pack_s5a8(s5.q, s5.d))
            out[f"s5a8_ref_{T}_{D}_{O}"] = quant.matmul_reference_w4a8(x, s5)
        out[f"w8a32_{T}_{D}_{O}"] = matmul_w8a32(x, pack_w8a32(q.wq), q.scale)
        out[f"w8a32_ref_{T}_{D}_{O}"] = quant.matmul_reference(x, quant.QuantizedLinear(q.wq, q.scale, "int8"))
    for T, D, O in ((1, 256, 48), (5, 512, 32)):                       # the 6-bit tile: Q6_K's blocks of 256
        x = rng.standard_normal((T, D)).astype(np.float32)
        q6 = quant.Q6Linear(rng.integers(0, 64, (D, O)).astype(np.uint8),
                            rng.integers(-128, 128, (D // 16, O)).astype(np.int8),
                            (rng.random((D // 256, O)) * 0.01).astype(np.float16).astype(np.float32))
        xu, sx = np.empty(x.shape, np.uint8), np.empty((T, D // 32), np.float32)
        quantize_rows(x, xu, sx)
        out[f"q6a8_{T}_{D}_{O}"] = matmul_w4a8(xu, sx, pack_q6a8(q6.q, q6.sc, q6.d))
        out[f"q6a8_ref_{T}_{D}_{O}"] = quant.matmul_reference_q6(x, q6)
    prompt = [5, 17, 99, 3, 42, 250, 7, 7, 128]
    for mode in ("int8", "w8a8", "w8a8-64", "w4a8", "gguf"):
        tiny = ts.tiny_model(seed=0, **({"dim": 128, "intermediate_size": 192} if mode == "w8a8-64" else {}))
        fast = backend.set_backend(quant.quantize_model(tiny, mode), mode, "numba")
        out[f"logits_{mode}"] = naive.forward(fast, prompt)
        greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
        out[f"greedy_{mode}"] = np.array(kv_cache.generate(fast, prompt, params=greedy))   # the fused decode step
    long_prompt = [int(t) for t in rng.integers(3, 250, 40)]        # a prefill long enough for BLAS_FROM_ROWS
    fast = backend.set_backend(quant.quantize_model(ts.tiny_model(seed=0), "int8"), "int8", "numba")
    out["prefill40_int8"] = kv_cache.prefill(fast, kv_cache.KVCache.allocate(fast.config, 40), long_prompt)
    out["prefill40_via_blas"] = np.array(fast.fast.float32 is not None)
    from numba import njit
    from tinyserve.kernels import matmul
    blocks = njit(matmul.matmul_blocks.py_func)        # compiled afresh (a cached kernel keeps no assembly)
    T, D, O = 4, 128, 64
    args = (matmul.W8A8Weights(np.zeros((O // 16, D * 16), np.int8), np.zeros((1, O), np.int32),
                               np.ones(O, np.float32)), np.zeros((T, D), np.float32), np.zeros((T, D), np.uint8),
            np.ones((T, 1), np.float32), np.zeros((T, O), np.float32), False, 0, O // 16,
            np.zeros(matmul.ROWS * matmul.COLS * 16, np.float32))
    blocks(*args)
    asm = chr(10).join(blocks.inspect_asm().values())   # what the W8A8 tiles were compiled to
    out["asm"] = np.array([m for m in ("vpdpbusd", "vpmaddubsw", "zmm", "sdot") if m in asm])
    np.savez(sys.argv[1], **out)
    print("done", isa.describe())
""")


# variant -> its process and its results' file. Each compiles every kernel in a single thread, from an empty cache
# for any variant but this CPU's own (minutes): the others start when the suite's collection ends (conftest.py), in
# the scheduler's idle class, so they compile on whatever core the suite leaves idle while a parallel kernel of the
# suite keeps both its cores (at equal priority, or merely niced, a compile beside a multi-threaded test slows it
# several times over: a thread at a barrier waits out the compiler's time slice; docs/performance.md, "Spinning
# while the partner has no core").
_runs: dict[str, tuple[subprocess.Popen, Path]] = {}
_results: dict[str, dict] = {}       # variant -> its results: the CPU's own variant is compared against and tested,
                                     # but run once


def start_variants(folder: Path, only_others: bool = False) -> None:
    """Start a process for every variant this CPU runs that has not been started yet (only_others: all but the
    CPU's own, at idle priority)."""
    for variant in isa.supported()[1:] if only_others else isa.supported():
        if variant in _runs:
            continue
        env = {**os.environ, "TINYSERVE_KERNELS": variant}
        env.pop("TINYSERVE_PORTABLE_KERNELS", None)
        path = folder / f"{variant}.npz"
        # its output into files, not pipes: a full pipe would stall a variant nobody reads yet
        with open(path.with_suffix(".out"), "w") as out, open(path.with_suffix(".err"), "w") as err:
            _runs[variant] = subprocess.Popen([sys.executable, "-c", SCRIPT, str(path)], env=env, stdout=out,
                                              stderr=err, cwd=Path(__file__).resolve().parent.parent,
                                              preexec_fn=_idle_priority if only_others else None), path


def _idle_priority() -> None:
    """In the child, before it starts: only the CPU time nothing else wants (SCHED_IDLE), or nice 19 without it."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def stop_variants() -> None:
    """End every variant still running (its test deselected, failed early, or the run stopped first)."""
    for process, _ in _runs.values():
        process.kill()
        process.wait()


def run_variant(variant: str) -> dict:
    """The variant's results, waiting for its process (started by `start_variants`)."""
    if variant not in _results:
        process, path = _runs[variant]
        try:
            process.wait(timeout=1200)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"{variant}: the kernels did not compile and run in 1200 s")
        stdout, stderr = path.with_suffix(".out").read_text(), path.with_suffix(".err").read_text()
        assert process.returncode == 0 and "done" in stdout, stderr[-3000:]
        _results[variant] = dict(np.load(path))
    return _results[variant]


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Iterator[dict]:
    """The results of this CPU's own variant (the fastest it runs), computed the same way; the other variants'
    processes have been compiling since the suite's collection ended (conftest.py), any not started yet start here."""
    start_variants(tmp_path_factory.mktemp("variants"))
    yield run_variant(isa.supported()[0])
    stop_variants()


@pytest.mark.slow
@pytest.mark.parametrize("variant", isa.ORDER)
def test_variant_is_exact_and_agrees_with_this_cpus_own(variant, native):
    if variant not in isa.supported():
        pytest.skip(f"this CPU cannot run {variant} (it runs {', '.join(isa.supported())})")
    got = run_variant(variant)
    assert str(got["variant"]) == variant
    expected = {"avx512vnni": {"vpdpbusd", "zmm"}, "avxvnni": {"vpdpbusd"}, "avx2": {"vpmaddubsw"}, "neon": {"sdot"}}
    if variant in expected:       # the instructions the variant is about, and no 512-bit register below AVX-512
        assert set(got["asm"].tolist()) == expected[variant], f"{variant} compiled to {got['asm']}"
    for key in (k for k in got if k.startswith("w8a8_") and "_ref_" not in k):
        ref = got[key.replace("w8a8_", "w8a8_ref_", 1)]
        assert np.array_equal(got[key], ref), f"{variant}: W8A8 {key} not bit-exact: max {np.abs(got[key] - ref).max()}"
    for kind in ("w4a8", "b8a8", "s4a8", "q6a8", "s8a8", "q5a8", "s5a8"):   # every layout of the W4A8 tile
        for key in (k for k in got if k.startswith(kind + "_") and "_ref_" not in k):
            ref = got[key.replace(kind + "_", kind + "_ref_", 1)]
            assert np.array_equal(got[key], ref), f"{variant}: {key} not bit-exact: max {np.abs(got[key] - ref).max()}"
    for key in (k for k in got if k.startswith("w8a32_") and "_ref_" not in k):
        ref = got[key.replace("w8a32_", "w8a32_ref_", 1)]
        np.testing.assert_allclose(got[key], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=key)
    # W8A32 prefills of many rows go through BLAS where the tiles cannot beat it (kernels/forward.py): within
    # W8A32's tolerance of the tiles, and only on the variants that rule names
    from tinyserve.kernels.forward import BLAS_FROM_ROWS
    assert bool(got["prefill40_via_blas"]) == (40 >= BLAS_FROM_ROWS.get(variant, 41)), (
        f"{variant}: a 40-row int8 prefill {'did not go' if got['prefill40_via_blas'] else 'went'} through BLAS")
    np.testing.assert_allclose(got["prefill40_int8"], native["prefill40_int8"], rtol=1e-4,
                               atol=1e-4 * np.abs(native["prefill40_int8"]).max(), err_msg="40-row int8 prefill")
    for key in got:
        if key not in ("variant", "asm", "prefill40_int8", "prefill40_via_blas"):
            assert np.array_equal(got[key], native[key]), (
                f"{variant} vs {native['variant']}: {key} differs (max {np.abs(got[key] - native[key]).max()})")


# --- the choice itself (no compiling) -------------------------------------------------------------------------------

ZEN3 = {"avx2": True, "fma": True, "avx512f": False, "avxvnni": False}                  # AVX2 only
SAPPHIRE = {"avx2": True, "fma": True, "avx512f": True, "avx512bw": True, "avx512vnni": True, "avxvnni": True}
GRAVITON = {"neon": True, "dotprod": True}


@pytest.mark.parametrize("features, arch, want", [
    (SAPPHIRE, "x86", ["avx512vnni", "avxvnni", "avx2", "generic"]),
    (ZEN3, "x86", ["avx2", "generic"]),
    ({**ZEN3, "avxvnni": True}, "x86", ["avxvnni", "avx2", "generic"]),          # Alder Lake: VNNI on ymm only
    ({"sse4.2": True}, "x86", ["generic"]),                                     # no AVX2: plain loops
    (GRAVITON, "arm64", ["neon", "generic"]),
    ({"neon": True}, "arm64", ["generic"]),                                     # NEON without dotprod
    (SAPPHIRE, "arm64", ["generic"]),                                           # an x86 name on arm64 means nothing
])
def test_supported_variants_follow_the_features(features, arch, want):
    assert isa.supported(features, arch) == want


def test_the_choice_is_the_fastest_unless_forced():
    assert isa.choose({}, ZEN3, "x86") == "avx2"
    assert isa.choose({"TINYSERVE_KERNELS": "generic"}, ZEN3, "x86") == "generic"
    assert isa.choose({"TINYSERVE_PORTABLE_KERNELS": "1"}, SAPPHIRE, "x86") == "generic"    # the older name
    with pytest.raises(ValueError, match="cannot run it"):
        isa.choose({"TINYSERVE_KERNELS": "avx512vnni"}, ZEN3, "x86")
    with pytest.raises(ValueError, match="choose one of"):
        isa.choose({"TINYSERVE_KERNELS": "sse9"}, ZEN3, "x86")


def test_a_forced_variant_switches_off_the_wider_features():
    f = {e[1:]: e[0] for e in isa.forced_features("avx2", {**SAPPHIRE, "avx10.1": True}).split(",")}
    assert f["avx2"] == "+" and f["fma"] == "+"
    assert all(f[k] == "-" for k in ("avx512f", "avx512bw", "avx512vnni", "avxvnni", "avx10.1"))
    assert isa.forced_features("avx512vnni", SAPPHIRE) is None                 # the CPU's own: its own features


@pytest.mark.parametrize("registers, v, R, C, extra, want", [
    (32, 1, 4, 4, 1, (4, 4)),      # AVX-512: 16 accumulators + 4 weights + a broadcast fit in 32 zmm
    (32, 1, 6, 4, 1, (6, 4)),      # the W8A32 prefill tile: 24 + 4 + 1
    (16, 2, 4, 4, 4, (2, 2)),      # AVX2 int8: 8 ymm accumulators + 4 weights + x, |x|, ones, a temporary
    (16, 2, 1, 4, 4, (1, 4)),      # one row: the weights stream through one register
    (16, 2, 6, 4, 2, (6, 1)),      # AVX2 float: 12 accumulators + 2 weights + 2
    (32, 4, 4, 4, 1, (2, 2)),      # NEON: a 16-lane block is 4 q registers
])
def test_subtiles_fit_the_register_file(registers, v, R, C, extra, want):
    r, c = isa.plan_subtiles(R, C, extra, registers, v)
    assert (r, c) == want
    assert v * r * c + (v * c if r > 1 else 1) + extra <= registers


COMPILE_TILES = textwrap.dedent("""
    import numpy as np
    from numba import njit
    from tinyserve.kernels import int4_dot
    from tinyserve.kernels.matmul import COLS, ROWS
    nb = 18                                          # 576 inputs, 18 blocks of 32
    for R, C, whole in ((ROWS, COLS, False), (1, 1, False), (ROWS, COLS, True)):   # nibbles, then the byte tile
        tile = int4_dot.make_w4a8_tile(R, C, whole_bytes=whole)
        gb = int4_dot.BYTE_GROUP_BYTES if whole else int4_dot.GROUP_BYTES

        @njit                                        # not cached: every run compiles the tile again
        def run(x, w, sx, xs, out):
            tile(x, 0, nb * 32, w, 0, nb * gb, nb, sx, xs, 0, nb, out, 0, 16 * C)
        out = np.ones(R * 16 * C, np.float32)
        sums = np.ones(R * nb, np.int32 if whole else np.float32)  # (the byte tile's: the sums, int32)
        run(np.zeros(R * nb * 32, np.uint8), np.zeros(C * nb * gb + 4096, np.uint8),
            np.ones(R * nb, np.float32), sums, out)
        assert not out.any()                         # zero activations and weights: every output is 0
    print("done")
""")


@pytest.mark.parametrize("variant", isa.ORDER)
def test_the_w4a8_tile_compiles_in_seconds(variant):
    """The W4A8 tile's code generation returns: once, with the activations' sign bits flipped after the broadcast (a
    <64 x i8> xor feeding vpdpbusd.512), LLVM 22 never finished compiling it on an AVX-512 VNNI Xeon (the fused
    step, which holds it, hung every first run there). ~1 s a variant; 120 s is a hang, not a slow machine."""
    if variant not in isa.supported():
        pytest.skip(f"this CPU cannot run {variant} (it runs {', '.join(isa.supported())})")
    env = {**os.environ, "TINYSERVE_KERNELS": variant}
    env.pop("TINYSERVE_PORTABLE_KERNELS", None)
    try:
        r = subprocess.run([sys.executable, "-c", COMPILE_TILES], env=env, capture_output=True, text=True,
                           timeout=120, cwd=Path(__file__).resolve().parent.parent)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{variant}: the W4A8 tile did not compile in 120 s (LLVM's code generator hung)")
    assert r.returncode == 0 and "done" in r.stdout, r.stderr[-3000:]
