"""int8 kernels and the quantised model are exact where integer arithmetic allows, and say so where it does not.

What must hold (lesson 7):
- W8A8: the Numba kernel (VNNI microkernels, or the portable loop) equals quant.matmul_reference bit for bit: every
  dot product is an exact integer in int32, then the same float32 scalings in the same order.
- W8A32 (weight-only): float32 sums in another order than BLAS. Tolerance: |kernel - reference| <= 1e-6 * sum_i
  |x_i * w_io| (+1e-30): float32 has a unit roundoff of 6e-8, and a sum of D terms in any order is within ~D * 6e-8
  of the exact one in the worst case, ~sqrt(D) * 6e-8 typically; D <= 256 here. Measured: <= 1.5e-7 of that sum.
- the packed layouts hold every weight exactly once where the kernels look for it; quantize_rows (Numba) gives the
  NumPy reference's int8 values and scales exactly;
- the fast forward = model.forward of the same quantised weights: exactly for w8a8 given NumPy's exp for SiLU
  (kernels.forward.silu_exp = np.exp; by default exp32, close), within tolerance for int8; so
  greedy tokens through kv_cache and the Engine are identical between the backends (tiny model and SmolLM2);
- bad quant / backend values are refused with a sentence; the int8 tensors cached on disk are reused by the next
  load and rebuilt when model.safetensors changes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyserve as ts
from tinyserve import backend, kv_cache, naive, quant
from tinyserve.engine import Engine
from tinyserve.gqa import grouped_attention
from tinyserve.kernels import forward as kernel_forward
from tinyserve.kernels.matmul import (BLOCK, block_sums, matmul_w8a8, matmul_w8a32, pack_vnni, pack_w8a32,
                                      quantize_rows as quantize_rows_numba)
from tinyserve.sampling import SamplingParams
from tinyserve.weights import save_hf_folder

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)
GREEDY24 = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=24)
GREEDY16 = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=16)


def random_case(seed: int, T: int, D: int, O: int, outliers: bool = True):
    """x [T, D] float32 and w [D, O] float32, with a few large activations (as in real residual streams)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, D)).astype(np.float32)
    if outliers:
        x[rng.integers(0, T, 3), rng.integers(0, D, 3)] *= 20
    w = (rng.standard_normal((D, O)) / np.sqrt(D)).astype(np.float32)
    return x, w


def w8a8_kernel(x: np.ndarray, q: quant.QuantizedLinear, out=None, accumulate=False, n_blocks: int = 1) -> np.ndarray:
    """The Numba W8A8 path: activations quantised with n_blocks scales per row (1: the per-token sx [T])."""
    xu = np.empty(x.shape, np.uint8)
    sx = np.empty(x.shape[0] if n_blocks == 1 else (x.shape[0], n_blocks), np.float32)
    quantize_rows_numba(x, xu, sx)
    wsum = q.wq.sum(axis=0, dtype=np.int32) if n_blocks == 1 else block_sums(q.wq, n_blocks)
    return matmul_w8a8(xu, sx, pack_vnni(q.wq), wsum, q.scale, out, accumulate)


def w8a32_bound(x: np.ndarray, q: quant.QuantizedLinear) -> np.ndarray:   # [T, O]: the tolerance of each output
    return 1e-6 * (np.abs(x).astype(np.float64) @ np.abs(q.dequantize()).astype(np.float64)) + 1e-30


shapes = st.tuples(st.integers(1, 40), st.integers(1, 64).map(lambda n: 4 * n),
                   st.integers(1, 16).map(lambda n: 16 * n),
                   st.integers(0, 2**32 - 1))


# --- the matmuls -------------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(shapes)
def test_w8a8_kernel_is_bit_exact(case):
    T, D, O, seed = case
    x, w = random_case(seed, T, D, O)
    q = quant.quantize_weight(w, "w8a8")
    ref = quant.matmul_reference(x, q)                                          # [T, O]
    got = w8a8_kernel(x, q)
    assert got.dtype == np.float32 and got.shape == (T, O)
    assert np.array_equal(got, ref), f"max diff {np.abs(got - ref).max():.3g}"
    # accumulate=True adds into `out` (the residual stream): the same float32 addition as `out + y`
    base = np.random.default_rng(seed).standard_normal((T, O)).astype(np.float32)
    out = base.copy()
    w8a8_kernel(x, q, out=out, accumulate=True)
    assert np.array_equal(out, base + ref)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.sampled_from([(64, 1), (128, 2), (192, 3), (576, 9), (1536, 24), (96, 3), (20, 5)]),
       st.integers(1, 8).map(lambda n: 16 * n), st.integers(0, 2**32 - 1))
def test_w8a8_per_block_kernel_is_bit_exact(T, d_nb, O, seed):
    """One activation scale per block of D / nb inputs (mode w8a8-64 and any other split): every block's integer dot
    product is exact, and the kernel adds the scaled blocks in the reference's order, so the bits agree."""
    D, nb = d_nb
    x, w = random_case(seed, T, D, O)
    q = quant.quantize_weight(w, "w8a8")
    assert quant.quantize_blocks(x, nb)[1].shape == (T, nb)
    want = _blocked_reference(x, q, nb)   # the definition written out: exact block sums, scaled, added in order
    if D % 64 == 0:
        assert np.array_equal(quant.matmul_reference(x, quant.QuantizedLinear(q.wq, q.scale, "w8a8-64")),
                              _blocked_reference(x, q, D // 64))
    got = w8a8_kernel(x, q, n_blocks=nb)
    assert np.array_equal(got, want), f"max diff {np.abs(got - want).max():.3g}"
    base = np.random.default_rng(seed).standard_normal((T, O)).astype(np.float32)
    out = base.copy()
    w8a8_kernel(x, q, out=out, accumulate=True, n_blocks=nb)
    assert np.array_equal(out, base + want)


def _blocked_reference(x, q, nb):
    xq, sx = quant.quantize_blocks(x, nb)
    y = np.zeros((x.shape[0], q.wq.shape[1]), np.float32)
    for b in range(nb):
        s = slice(b * x.shape[1] // nb, (b + 1) * x.shape[1] // nb)
        y = y + (xq[:, s].astype(np.int64) @ q.wq[s].astype(np.int64)).astype(np.float32) * sx[:, b:b + 1]
    return y * q.scale


def test_blocks_give_an_outlier_its_own_scale():
    """The point of w8a8-64: one activation 100x the others costs only its own block's resolution. Per token, the
    other 127 values of this row round to 0 or +-1; per block, those outside the outlier's block keep ~7 bits."""
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, 128)).astype(np.float32)
    x[0, 3] = 100.0
    xq, sx = quant.quantize_rows(x)
    xb, sb = quant.quantize_blocks(x, 2)
    assert np.abs(xq[0, 64:]).max() <= 1, "per token, the outlier's scale leaves the rest ~1 int8 step"
    assert sb[0, 0] == sx[0] and sb[0, 1] < sx[0] / 50 and np.abs(xb[0, 64:]).max() == 127
    w = rng.standard_normal((128, 32)).astype(np.float32)
    w[:64] = 0.0                               # outputs that read only the second block, away from the outlier
    exact = x.astype(np.float64) @ quant.quantize_weight(w).dequantize()
    err = lambda mode: np.abs(quant.matmul_reference(x, quant.quantize_weight(w, mode)) - exact).max()  # noqa: E731
    assert err("w8a8-64") < err("w8a8") / 20, "per block, the outlier should not cost the other block precision"


def test_blocks_must_divide_the_input():
    with pytest.raises(ValueError, match="do not split into blocks of 64"):
        quant.matmul_reference(np.ones((1, 160), np.float32), quant.quantize_weight(np.ones((160, 16), np.float32),
                                                                                     "w8a8-64"))
    with pytest.raises(ValueError, match="w_down.*160 inputs do not split into blocks of 64"):
        quant.quantize_model(ts.tiny_model(), "w8a8-64")            # F = 160: said when the model is quantised
    with pytest.raises(ValueError, match="160 inputs do not split into blocks of 64"):
        quant.with_mode(quant.quantize_model(ts.tiny_model(), "int8"), "w8a8-64")


def test_w8a8_kernel_extremes():
    """All-zero rows (scale falls back to 1), saturated int8 on both sides (-127 * -127 summed over D = 1536:
    24.8 M, far below 2^31, the largest sum SmolLM2 can produce), and a zero weight column."""
    D, O = 1536, 48
    x = np.zeros((3, D), np.float32)
    x[1] = -1.0                          # every activation -> -127
    x[2, ::2], x[2, 1::2] = 5.0, -5.0
    w = -np.ones((D, O), np.float32)     # every weight -> -127
    w[:, 5] = 0.0
    q = quant.quantize_weight(w, "w8a8")
    got, ref = w8a8_kernel(x, q), quant.matmul_reference(x, q)
    assert np.array_equal(got, ref)
    assert abs(got[1, 0] - D) < 1e-3 * D      # the integer sum 127 * 127 * 1536 = 24,774,144, times 1/127 twice
    assert (got[0] == 0).all() and (got[:, 5] == 0).all()


@settings(max_examples=40, deadline=None)
@given(shapes)
def test_w8a32_kernel_within_stated_tolerance(case):
    T, D, O, seed = case
    x, w = random_case(seed, T, D, O)
    q = quant.quantize_weight(w, "int8")
    ref = quant.matmul_reference(x, q)
    out = np.zeros((T, O), np.float32)
    got = matmul_w8a32(x, pack_w8a32(q.wq), q.scale, out)
    assert got is out and got.shape == (T, O)
    err = np.abs(got.astype(np.float64) - ref)
    assert (err <= w8a32_bound(x, q)).all(), f"worst error / bound {(err / w8a32_bound(x, q)).max():.3g}"


@settings(max_examples=15, deadline=None)
@given(st.integers(32, 200), st.integers(1, 40).map(lambda n: 4 * n), st.integers(1, 12).map(lambda n: 16 * n),
       st.integers(0, 2**32 - 1))
def test_w8a32_prefill_path_is_bit_identical_to_the_tiled_one(T, D, O, seed):
    """From WIDE_MIN_ROWS rows on, matmul_w8a32 widens each weight group once per chunk of rows instead of in every
    tile: the same fma per output in the same order, so not one bit may change."""
    from tinyserve.kernels import matmul as mm
    assert T >= mm.WIDE_MIN_ROWS
    x, w = random_case(seed, T, D, O)
    q = quant.quantize_weight(w, "int8")
    wp = pack_w8a32(q.wq)
    tiled, wide = np.zeros((T, O), np.float32), np.ones((T, O), np.float32)
    mm._matmul_w8a32(x, wp, q.scale, tiled, False)
    mm._matmul_w8a32_wide(x, wp, q.scale, wide, True)            # accumulate=True onto ones
    assert np.array_equal(wide, np.float32(1) + tiled)
    assert np.array_equal(matmul_w8a32(x, wp, q.scale), tiled)   # and the public function takes it


# --- the layouts and the activation quantiser ------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(st.integers(1, 32).map(lambda n: 4 * n), st.integers(1, 8).map(lambda n: 16 * n), st.integers(0, 2**32 - 1))
def test_packings_round_trip(D, O, seed):
    wq = np.random.default_rng(seed).integers(-127, 128, (D, O)).astype(np.int8)
    p = pack_vnni(wq)                                                           # [O/16, D/4*64]
    assert p.shape == (O // BLOCK, D // 4 * 64) and p.dtype == np.int8
    # byte 64 i + 4 l + k of block b is W[4 i + k, 16 b + l]: undo it and get W back
    back = p.reshape(O // BLOCK, D // 4, BLOCK, 4).transpose(1, 3, 0, 2).reshape(D, O)
    assert np.array_equal(back, wq)
    b, i, l, k = O // BLOCK - 1, D // 4 - 1, 3, 2                               # one element by the formula
    assert p[b, 64 * i + 4 * l + k] == wq[4 * i + k, 16 * b + l]
    f = pack_w8a32(wq)                                                          # [O/16, D, 16]
    assert f.shape == (O // BLOCK, D, BLOCK)
    assert np.array_equal(f.transpose(1, 0, 2).reshape(D, O), wq)


@pytest.mark.parametrize("shape", [(6, 8), (4, 20)])
def test_packings_refuse_shapes_they_cannot_hold(shape):
    wq = np.zeros(shape, np.int8)
    with pytest.raises(ValueError, match="pack_vnni needs"):
        pack_vnni(wq)
    if shape[1] % BLOCK:
        with pytest.raises(ValueError, match="pack_w8a32 needs"):
            pack_w8a32(wq)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 300), st.integers(0, 2**32 - 1), st.sampled_from([1e-3, 1.0, 300.0]))
def test_quantize_rows_matches_reference_exactly(T, D, seed, magnitude):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, D)) * magnitude).astype(np.float32)
    x[0, :] = 0.0                                                               # a zero row: scale 1, all zeros
    if D > 1:                                                                   # ties: exactly half a step
        x[-1, 0], x[-1, 1] = 127.0, 0.5
    xq, sx = quant.quantize_rows(x)
    xu, sx2 = np.empty((T, D), np.uint8), np.empty(T, np.float32)
    quantize_rows_numba(x, xu, sx2)
    assert np.array_equal(xu.astype(np.int16) - 128, xq) and np.array_equal(sx2, sx)
    assert np.abs(xq).max() <= 127 and sx[0] == 1.0
    nb = next(n for n in (5, 3, 2, 1) if D % n == 0)                           # and per block
    xq, sx = quant.quantize_blocks(x, nb)
    xu, sx2 = np.empty((T, D), np.uint8), np.empty((T, nb), np.float32)
    quantize_rows_numba(x, xu, sx2)
    assert np.array_equal(xu.astype(np.int16) - 128, xq) and np.array_equal(sx2, sx)


# --- the whole model ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_q():
    """mode -> (numpy reference, numba) of the same quantised tiny model."""
    out = {}
    for mode in ("int8", "w8a8", "w8a8-64"):   # w8a8-64: a tiny model whose inputs split into blocks of 64
        base = ts.tiny_model(seed=0, **({"dim": 128, "intermediate_size": 192} if mode == "w8a8-64" else {}))
        ref = quant.quantize_model(base, mode)
        out[mode] = (ref, backend.set_backend(ref, mode, "numba"))
    return out


TINY_PROMPT = [5, 17, 99, 3, 42, 250, 7, 7, 128, 64, 1, 200]


def test_fast_forward_equals_reference_on_tiny(tiny_q, monkeypatch):
    for mode in ("w8a8", "w8a8-64"):
        ref, fast = tiny_q[mode]
        a, b = naive.forward(ref, TINY_PROMPT), naive.forward(fast, TINY_PROMPT)   # [T, V] each
        assert fast.fast is not None, "the numba backend did not run its fast forward"
        # by default SiLU's exp is fast_exp.exp32 (<= 2e-7 relative of NumPy's): close, not equal
        np.testing.assert_allclose(b, a, atol=0.05 * np.abs(a).max())
        with monkeypatch.context() as mp:                # NumPy's exp, as the reference: every other step is exact
            mp.setattr(kernel_forward, "silu_exp", np.exp)
            b = naive.forward(fast, TINY_PROMPT)
        assert np.array_equal(a, b), f"{mode} must be exact, max diff {np.abs(a - b).max():.3g}"
    ref, fast = tiny_q["int8"]
    a, b = naive.forward(ref, TINY_PROMPT), naive.forward(fast, TINY_PROMPT)
    # float32 sums in another order in every matmul and norm, 2 layers deep: ~1e-6 relative on O(10) logits
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


@pytest.mark.parametrize("mode", ["int8", "w8a8", "w8a8-64"])
def test_greedy_tokens_identical_across_backends_tiny(tiny_q, mode):
    ref, fast = tiny_q[mode]
    prompts = [TINY_PROMPT, [3, 1, 4, 1, 5, 9, 2, 6]]
    want = [kv_cache.generate(ref, p, 24, GREEDY) for p in prompts]
    assert [kv_cache.generate(fast, p, 24, GREEDY) for p in prompts] == want
    eng = lambda m: Engine(m, num_blocks=32, block_size=4, max_batch_tokens=16)   # noqa: E731 (chunked prefill)
    assert eng(ref).generate(prompts, GREEDY24) == want
    assert eng(fast).generate(prompts, GREEDY24) == want


@pytest.mark.real
@pytest.mark.parametrize("mode", ["int8", "w8a8", "w8a8-64"])
def test_greedy_tokens_identical_across_backends_smol(smol, mode, monkeypatch):
    from tests.quant_accuracy import reference_prompts
    monkeypatch.setattr(kernel_forward, "silu_exp", np.exp)   # the reference's SiLU: W8A8 is then bit-exact
    ref = quant.quantize_model(smol, mode)
    fast = backend.set_backend(ref, mode, "numba")
    prompts = [ids for name, ids in reference_prompts().items() if name in ("english", "chat")]
    want = [kv_cache.generate(ref, p, 16, GREEDY) for p in prompts]
    # the int8 kernels against the reference under the same (NumPy) attention: bit-identical for W8A8
    same_attention = [list(kv_cache.generate_stream(fast, p, 16, GREEDY, attend=grouped_attention)) for p in prompts]
    assert same_attention == want
    if mode == "int8":   # float32 activations: the Numba attention kernels' float order changes no token either
        assert [kv_cache.generate(fast, p, 16, GREEDY) for p in prompts] == want
    # W8A8 with the Numba attention kernels is token-identical only as far as their ~1e-7 float differences never
    # move an activation across an int8 rounding boundary: measured, not guaranteed (the last test of this file).
    # The Engine: the int8 kernels against the NumPy reference with the same (NumPy) paged attention.
    assert Engine(fast, backend="numpy").generate(prompts, GREEDY16) == Engine(ref).generate(prompts, GREEDY16)


# --- choosing and caching --------------------------------------------------------------------------------------

def write_tiny_folder(path, seed: int = 0):
    """A folder load_model reads: the tiny model's tensors in the Hugging Face layout ([out, in] matrices)."""
    m = ts.tiny_model(seed=seed)
    t = {"model.embed_tokens.weight": m.embed, "model.norm.weight": m.final_norm}
    names = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "wq": "self_attn.q_proj",
             "wk": "self_attn.k_proj", "wv": "self_attn.v_proj", "wo": "self_attn.o_proj",
             "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj", "w_down": "mlp.down_proj"}
    for i, w in enumerate(m.layers):
        for f, hf in names.items():
            a = getattr(w, f)
            t[f"model.layers.{i}.{hf}.weight"] = np.ascontiguousarray(a.T if a.ndim == 2 else a)
    save_hf_folder(t, m.config, path)
    return m


def test_bad_quant_or_backend_is_refused(tmp_path):
    write_tiny_folder(tmp_path)
    with pytest.raises(ValueError, match="quant must be one of"):
        ts.load_model(tmp_path, quant="int4")
    with pytest.raises(ValueError, match="backend must be one of"):
        ts.load_model(tmp_path, quant="int8", backend="cuda")
    with pytest.raises(ValueError, match="quant must be one of"):
        quant.quantize_model(ts.tiny_model(), "fp8")


def test_disk_cache_is_reused_then_rebuilt_when_the_weights_change(tmp_path, monkeypatch):
    m0 = write_tiny_folder(tmp_path, seed=0)
    first = ts.load_model(tmp_path, quant="int8")
    assert (tmp_path / "model.int8.safetensors").exists()
    key = json.loads((tmp_path / "model.int8.json").read_text())
    assert np.array_equal(first.layers[1].w_down.wq, quant.quantize_weight(m0.layers[1].w_down).wq)

    # a second start (either mode) reads the cache and does not quantise
    def no_quantising(*args, **kwargs):
        raise AssertionError("quantised again although the cache is valid")
    with monkeypatch.context() as mp:
        mp.setattr(quant, "quantize_model", no_quantising)
        for mode in ("int8", "w8a8"):
            again = ts.load_model(tmp_path, quant=mode)
            assert again.quant == mode and again.layers[0].wq.mode == mode
            for f in quant.MATRICES:
                assert np.array_equal(getattr(again.layers[1], f).wq, getattr(first.layers[1], f).wq)
                assert np.array_equal(getattr(again.layers[1], f).scale, getattr(first.layers[1], f).scale)
            assert np.array_equal(again.lm_head_q.wq, first.lm_head_q.wq)

    # new weights in the same place (same shapes, so the same file size): the cache must not be served
    m1 = write_tiny_folder(tmp_path, seed=1)
    rebuilt = ts.load_model(tmp_path, quant="w8a8")
    assert json.loads((tmp_path / "model.int8.json").read_text()) != key
    assert np.array_equal(rebuilt.layers[1].w_down.wq, quant.quantize_weight(m1.layers[1].w_down).wq)
    assert not np.array_equal(rebuilt.layers[1].w_down.wq, first.layers[1].w_down.wq)
    np.testing.assert_array_equal(naive.forward(rebuilt, TINY_PROMPT),
                                  naive.forward(quant.quantize_model(m1, "w8a8"), TINY_PROMPT))


def test_set_backend_switches_an_already_quantised_model():
    """Found while writing these tests: set_backend(quantised model, same mode, "numba") quantised the
    QuantizedLinears again (TypeError deep in NumPy) instead of only switching the backend."""
    q = quant.quantize_model(ts.tiny_model(), "w8a8")
    fast = backend.set_backend(q, "w8a8", "numba")
    assert fast.backend == "numba" and fast.layers[0].wq is q.layers[0].wq     # the same int8 tensors
    back = backend.set_backend(fast, "int8", "numpy")
    assert back.backend == "numpy" and back.quant == "int8" and back.layers[0].wq.wq is q.layers[0].wq.wq
    with pytest.raises(ValueError, match="already quantised"):
        backend.set_backend(q, "none", "numpy")
