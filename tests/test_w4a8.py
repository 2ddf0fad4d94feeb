"""W4A8: the GGUF's own 4-bit weights (Q4_1) times int8 activations (quant.py, kernels/int4_dot.py).

What must hold:
- quantize_q4_1 gives Q4_1 weights back exactly (q, d and m), and rounds any other weights to within half a step;
- pack_w4a8 puts every nibble and scale where the tile reads it;
- the W4A8 matmul is bit-identical to quant.matmul_reference_w4a8 (integer block sums, the same float32 operations
  in the same order), through every entry the kernels use: matmul_w4a8, the int8-activation matmul of layer.py's
  kernels (_matmul_int8, which takes W4A8 weights by their kind), and one thread's share (matmul_blocks);
- a w4a8 model on the numba backend computes what the NumPy reference computes, and fails clearly where it cannot
  become another mode;
- quant="auto" picks w4a8 exactly for models whose layers are Q4_1 already.
The fused decode step's W4A8 runs are in tests/test_decode_step.py, every instruction set's in
tests/test_isa_variants.py, SmolLM2's accuracy in tests/test_quant_accuracy.py.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tinyserve as ts
from tinyserve import backend, kv_cache, naive, quant
from tinyserve.kernels import decode_step
from tinyserve.kernels import forward as fast
from tinyserve.kernels import matmul as km


def q4_1_weights(rng, D: int, O: int) -> np.ndarray:
    """[D, O] float32 weights that are Q4_1 blocks, as a GGUF's: w = d * q + m with d, m float16 values and every
    block holding a 0 and a 15 (llama.cpp's quantiser puts the block's min at q = 0 and its max at q = 15)."""
    q = rng.integers(0, 16, (D, O))
    q[0::32], q[1::32] = 0, 15
    d = rng.uniform(1e-3, 2e-2, (D // 32, O)).astype(np.float16).astype(np.float32)
    m = rng.uniform(-0.2, 0.0, (D // 32, O)).astype(np.float16).astype(np.float32)
    return (np.repeat(d, 32, axis=0) * q.astype(np.float32) + np.repeat(m, 32, axis=0)).astype(np.float32)


def activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [T, D] -> the kernels' uint8 activations (+128) and scales per 32 (quant.quantize_blocks' values)."""
    xq, sx = quant.quantize_blocks(x, x.shape[1] // 32)
    return (xq.astype(np.int16) + 128).astype(np.uint8), sx


def test_q4_1_weights_come_back_exactly():
    w = q4_1_weights(np.random.default_rng(0), 128, 48)
    q = quant.quantize_q4_1(w)
    assert q.q.dtype == np.uint8 and q.q.max() == 15 and q.q.min() == 0
    np.testing.assert_array_equal(q.dequantize(), w)
    np.testing.assert_array_equal(q.d, q.d.astype(np.float16).astype(np.float32))     # float16 values, as stored
    assert q.nbytes == 128 * 48 // 2 + 2 * (4 * 48) * 2                                # 4.5 bits a weight + m


def test_other_weights_round_to_within_half_a_step():
    w = np.random.default_rng(1).standard_normal((64, 32)).astype(np.float32)
    w[:32, 0] = 0.25                                                   # a constant block: d = 0, exact
    q = quant.quantize_q4_1(w)
    err = np.abs(q.dequantize() - w).reshape(2, 32, 32)
    assert np.all(err <= 0.5 * q.d[:, None] * 1.01 + 1e-3 * np.abs(q.m[:, None]))
    assert q.d[0, 0] == 0 and np.all(q.dequantize()[:32, 0] == 0.25)
    with pytest.raises(ValueError, match="blocks of 32"):
        quant.quantize_q4_1(np.zeros((48, 16), np.float32))


def test_pack_puts_each_nibble_and_scale_where_the_tile_reads_it():
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (64, 32)).astype(np.uint8)
    d, m = rng.random((2, 32)).astype(np.float32), -rng.random((2, 32)).astype(np.float32)
    p = km.pack_w4a8(q, d, m)
    assert p.shape == (2, 2, km.GROUP_BYTES) and p.dtype == np.uint8
    for o, i in [(0, 0), (5, 3), (17, 33), (31, 63), (16, 38)]:
        c, b, l = o // 16, i // 32, o % 16
        step = i % 32 // 4
        byte = p[c, b, 64 + 64 * (step // 2) + 4 * l + i % 4]
        assert (byte >> 4 if step % 2 else byte & 15) == q[i, o], (o, i)
        halves = p[c, b, :64].view(np.float16)
        assert halves[l] == np.float16(d[b, o]) and halves[16 + l] == np.float16(m[b, o])


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 11), nb=st.integers(1, 6), n_out=st.integers(1, 9), seed=st.integers(0, 2**16),
       outlier=st.floats(1, 60))
def test_the_matmul_is_bit_identical_to_the_reference(T, nb, n_out, seed, outlier):
    rng = np.random.default_rng(seed)
    D, O = 32 * nb, 16 * n_out
    q = quant.quantize_q4_1(rng.standard_normal((D, O)).astype(np.float32))
    x = rng.standard_normal((T, D)).astype(np.float32)
    x[:, rng.integers(D)] *= outlier                                   # an outlier channel, as SmolLM2's
    x[T // 2] = 0                                                      # a row of zeros: every scale is 1
    want = quant.matmul_reference_w4a8(x, q)
    xu, sx = activations(x)
    wp = km.pack_w4a8(q.q, q.d, q.m)
    np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, wp), want)
    # the int8-activation matmul of layer.py's kernels, told apart by the weights' kind
    out = np.full((T, O), 1.5, np.float32)
    km._matmul_int8(km.w4a8_weights(wp), xu, sx, out, True)
    np.testing.assert_array_equal(out, np.float32(1.5) + want)
    # one thread's share of the fused decode step: output blocks lo .. hi only
    lo, hi = n_out // 3, n_out - n_out // 4
    part = np.zeros((T, O), np.float32)
    km.matmul_blocks(km.w4a8_weights(wp), x, xu, sx, part, False, lo, hi, np.empty(km.ROWS * km.COLS * 16, np.float32))
    np.testing.assert_array_equal(part[:, 16 * lo:16 * hi], want[:, 16 * lo:16 * hi])
    assert not part[:, :16 * lo].any() and not part[:, 16 * hi:].any()


def symmetric(q: quant.Q4Linear) -> quant.S4Linear:
    """The same nibbles and scales as Q4_0 blocks: m = -8 d (exact in float16)."""
    return quant.S4Linear(q.q, q.d, np.float32(-8) * q.d)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 11), nb=st.integers(1, 6), n_out=st.integers(1, 9), seed=st.integers(0, 2**16),
       outlier=st.floats(1, 60))
def test_the_symmetric_tile_is_the_nibble_tile_without_m_bit_for_bit(T, nb, n_out, seed, outlier):
    """Q4_0's blocks (m = -8 d) on the symmetric tile, which reads d only and forms m: the reference's bits, and the
    bits of the W4A8 tile reading the same m from memory, through every entry (as above)."""
    rng = np.random.default_rng(seed)
    D, O = 32 * nb, 16 * n_out
    q = symmetric(quant.quantize_q4_1(rng.standard_normal((D, O)).astype(np.float32)))
    q.d[rng.integers(D // 32), rng.integers(O)] = 0                    # an all-zero block: d = m = 0
    q.m[...] = np.float32(-8) * q.d
    x = rng.standard_normal((T, D)).astype(np.float32)
    x[:, rng.integers(D)] *= outlier
    x[T // 2] = 0
    want = quant.matmul_reference_w4a8(x, q)
    xu, sx = activations(x)
    wp = km.pack_s4a8(q.q, q.d)
    assert wp.shape == (O // 16, nb, km.SYM_GROUP_BYTES) and km.SYM_GROUP_BYTES == 288    # 18 bytes per 32
    np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, wp), want)
    np.testing.assert_array_equal(km.matmul_w4a8(xu, sx, km.pack_w4a8(q.q, q.d, q.m)), want)
    out = np.full((T, O), 1.5, np.float32)
    km._matmul_int8(km.s4a8_weights(wp), xu, sx, out, True)
    np.testing.assert_array_equal(out, np.float32(1.5) + want)
    lo, hi = n_out // 3, n_out - n_out // 4
    part = np.zeros((T, O), np.float32)
    km.matmul_blocks(km.s4a8_weights(wp), x, xu, sx, part, False, lo, hi, np.empty(km.ROWS * km.COLS * 16, np.float32))
    np.testing.assert_array_equal(part[:, 16 * lo:16 * hi], want[:, 16 * lo:16 * hi])


def test_pack_s4a8_keeps_d_and_the_nibbles_where_pack_w4a8_has_them():
    rng = np.random.default_rng(4)
    q = rng.integers(0, 16, (64, 32)).astype(np.uint8)
    d = rng.random((2, 32)).astype(np.float16).astype(np.float32)
    full, sym = km.pack_w4a8(q, d, -8 * d), km.pack_s4a8(q, d)
    np.testing.assert_array_equal(sym[:, :, :32], full[:, :, :32])      # d[16]
    np.testing.assert_array_equal(sym[:, :, 32:], full[:, :, 64:])      # the nibbles; m's 32 bytes are gone


def test_nibble_blocks_are_symmetric_only_if_every_m_is_minus_8_d():
    rng = np.random.default_rng(5)
    q = rng.integers(0, 16, (64, 32)).astype(np.uint8)
    d = rng.random((2, 32)).astype(np.float16).astype(np.float32)
    s = quant.nibble_linear(q, d, np.float32(-8) * d, quant.GGUF.name)
    assert type(s) is quant.S4Linear and s.nbytes == 64 * 32 // 2 + 2 * 32 * 2      # 18 bytes per 32 weights
    m = np.float32(-8) * d
    m[1, 7] = np.float16(m[1, 7] * 1.001)                                # one block off: the minimum must stay
    assert type(quant.nibble_linear(q, d, m, quant.GGUF.name)) is quant.Q4Linear


@pytest.fixture(scope="module")
def tiny_w4a8():
    """The tiny model with Q4_1 layers (its random weights rounded once): w4a8 then holds them exactly."""
    base = quant.quantize_model(ts.tiny_model(seed=0), "w4a8")
    layers = [dataclasses.replace(w, **{f: getattr(w, f).dequantize() for f in quant.MATRICES}) for w in base.layers]
    return dataclasses.replace(ts.tiny_model(seed=0), layers=layers)


def test_the_numba_path_computes_the_numpy_reference(tiny_w4a8, monkeypatch):
    """Prefill and decode on the kernels (three-call layers; SiLU's exp NumPy's, as the reference) against
    model.forward on the NumPy reference: the same logits up to attention's float order."""
    assert_numba_path_matches_numpy(quant.quantize_model(tiny_w4a8, "w4a8"), "w4a8")


def assert_numba_path_matches_numpy(qm, mode: str) -> None:
    """A quantised model on the numba backend (three-call layers, then the fused decode step's greedy tokens) against
    the same blocks on the NumPy reference: the same logits up to attention's float order, the same tokens."""
    ref, numba_model = backend.set_backend(qm, mode, "numpy"), backend.set_backend(qm, mode, "numba")
    prompt = [5, 17, 99, 3, 42, 250, 7, 7, 128, 64, 1, 2]
    want = naive.forward(ref, prompt)
    with decode_step.three_call_path():
        got = naive.forward(numba_model, prompt)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    greedy = ts.SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=12)
    assert kv_cache.generate(numba_model, prompt, params=greedy) == kv_cache.generate(ref, prompt, params=greedy)


def test_packed_weights_are_4_bits_and_the_lm_head_int8(tiny_w4a8):
    m = backend.set_backend(tiny_w4a8, "w4a8", "numba")
    fw = fast.prepare(m)
    assert isinstance(fw.layers[0].qkv, km.W4A8Weights) and fw.layers[0].qkv.w.dtype == np.uint8
    assert isinstance(fw.lm_head, km.W8A8Weights) and fw.lm_head.w.dtype == np.int8  # the head: W8A8, per 32
    assert fw.lm_head.blocks.shape[0] == m.config.dim // 32
    D, F = m.config.dim, m.config.intermediate_size
    for f in quant.MATRICES:                          # half a byte a weight, d and m as float16 per 32 inputs
        d_in, d_out = getattr(m.layers[0], f).shape
        assert getattr(m.layers[0], f).nbytes == d_in * d_out // 2 + 2 * 2 * (d_in // 32) * d_out, f
    assert fw.layers[0].gate_up.w.nbytes == (2 * F // 16) * (D // 32) * km.GROUP_BYTES


def test_w4a8_cannot_become_an_int8_mode(tiny_w4a8):
    m = backend.set_backend(tiny_w4a8, "w4a8", "numba")
    with pytest.raises(ValueError, match="w4a8 holds other weights"):
        backend.set_backend(m, "w8a8-64", "numba")
    with pytest.raises(ValueError, match="w4a8 holds other weights"):
        quant.with_mode(backend.set_backend(tiny_w4a8, "int8", "numba"), "w4a8")


def test_auto_picks_w4a8_only_for_q4_1_weights(tiny_w4a8):
    from tinyserve.kernels import isa
    assert quant.is_q4_1(tiny_w4a8) and not quant.is_q4_1(ts.tiny_model(seed=0))
    if isa.NAME not in backend.W4A8_DEFAULT_ON:                            # not measured faster there (yet)
        assert "w4a8" not in (backend.default_quant(tiny_w4a8), backend.default_quant())
        return
    assert backend.default_quant(tiny_w4a8) == "w4a8"
    assert backend.default_quant(ts.tiny_model(seed=0)) != "w4a8"          # random weights: 4 bits would round them
    assert backend.default_quant() == "w4a8"                               # SmolLM2 (its layers are Q4_1)
    assert backend.set_backend(tiny_w4a8, "auto", "numba").quant == "w4a8"
