"""Lesson 7 self-checks: per-channel weight quantisation, per-row activation quantisation, the int8 matmul they
define, the VNNI layout, the W8A8 matmul in Numba (bit-exact), SmoothQuant's factors and online-softmax attention over
paged KV blocks.

`make check-7` runs these against lessons/07_kernels/exercises.py; `make test` runs them against tinyserve.
Where a check compares with tinyserve's own function it says why that function is the truth (the kernels and the
fast forward are tested bit for bit against it in tests/test_quant.py); every exercise also has hand-made cases.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.lessons.impl import CHECKS, load_impl
from tinyserve import paged, quant
from tinyserve.kernels import matmul as kernels

REFERENCE = {
    "quantize_weight": "tinyserve.quant:quantize_weight",
    "quantize_rows": "tinyserve.quant:quantize_rows",
    "matmul_reference": "tinyserve.quant:matmul_reference",
    "pack_vnni": "tinyserve.kernels.matmul:pack_vnni",
    "matmul_w8a8": "tinyserve.kernels.matmul:matmul_w8a8",
    "smoothing_factors": "tinyserve.quant:smoothing_factors",
    "online_attention": "tinyserve.online_attention:online_attention",
}
impl = load_impl(7, REFERENCE)


def rand(shape, seed=0, scale=1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


# --- quantize_weight -----------------------------------------------------------------------------------------------

@pytest.mark.exercise("quantize_weight")
def test_quantize_weight_by_hand():
    w = np.array([[1.0, -0.5, 0.0],
                  [-2.54, 0.25, 0.0],
                  [0.5, 0.2, 0.0]], np.float32)                                 # [D=3, O=3]; column 2 is all zero
    q = impl.quantize_weight(w, "w8a8")
    assert q.mode == "w8a8" and q.wq.dtype == np.int8 and q.scale.dtype == np.float32
    np.testing.assert_allclose(q.scale, [2.54 / 127, 0.5 / 127, 1.0], rtol=1e-6)   # one scale per column
    assert q.wq[:, 0].tolist() == [50, -127, 25]          # 1 / 0.02 = 50, 0.5 / 0.02 = 25
    assert q.wq[:, 1].tolist() == [-127, 64, 51]          # 63.5 -> 64 and 50.8 -> 51 (float32 w / scale)
    assert q.wq[:, 2].tolist() == [0, 0, 0]


@pytest.mark.exercise("quantize_weight")
def test_quantize_weight_rounds_ties_to_even():
    """Every column's maximum is 127, so its scale is exactly 1 and w / scale is w: the .5 ties below are exact.
    np.rint takes a tie to the even neighbour; floor(v + 0.5) (half up, what quantize_rows does) and C's round()
    (half away from zero) each differ from it on some of these ties."""
    ties = np.array([2.5, -2.5, -3.5, 0.5, -0.5, 1.5, -1.5, 126.5], np.float32)
    w = np.stack([np.append(ties, 127.0), np.append(-ties, -127.0)], axis=1)     # [D=9, O=2]
    q = impl.quantize_weight(w)
    assert q.scale.tolist() == [1.0, 1.0]
    assert q.wq[:-1, 0].tolist() == [2, -2, -4, 0, 0, 2, -2, 126], "np.rint: ties to even (2.5 -> 2, -3.5 -> -4)"
    assert q.wq[:-1, 1].tolist() == [-2, 2, 4, 0, 0, -2, 2, -126], "np.rint: ties to even (-2.5 -> -2, 3.5 -> 4)"


@pytest.mark.exercise("quantize_weight")
def test_quantize_weight_error_is_at_most_half_a_step():
    w = rand((96, 40), seed=1)
    w[:, 3] *= 100                                                              # a column with a large range
    q = impl.quantize_weight(w)
    assert q.mode == "int8" and q.wq.shape == (96, 40) and q.scale.shape == (40,)
    assert np.abs(q.wq.astype(int)).max() == 127 and q.wq.min() >= -127     # every column reaches +-127
    err = np.abs(q.wq.astype(np.float32) * q.scale - w)                       # [D, O]
    assert (err <= q.scale * 0.5001).all(), "rounding to the nearest step: at most scale / 2 off"
    assert np.array_equal(q.wq, quant.quantize_weight(w).wq) and np.array_equal(q.scale, quant.quantize_weight(w).scale)


@pytest.mark.exercise("quantize_weight")
def test_quantize_weight_of_a_transposed_view():
    e = rand((50, 8), seed=2)                                                   # like the tied embedding [V, D]
    q = impl.quantize_weight(e.T)                                               # its LM head view [D, V]
    assert q.wq.shape == (8, 50) and q.wq.flags.c_contiguous, "the kernels stream wq: it must be contiguous"
    np.testing.assert_allclose(q.wq * q.scale, e.T, atol=float(q.scale.max()) / 2 + 1e-7)


# --- quantize_rows -------------------------------------------------------------------------------------------------

@pytest.mark.exercise("quantize_rows")
def test_quantize_rows_by_hand_rounds_half_up():
    x = np.array([[127.0, 0.5, -0.5, 1.5, -1.5, 2.5],
                  [0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                  [-254.0, 1.0, 3.0, -3.0, 0.9, 127.0]], np.float32)             # [T=3, D=6]
    xq, sx = impl.quantize_rows(x)
    assert xq.dtype == np.int8 and sx.dtype == np.float32 and xq.shape == (3, 6) and sx.shape == (3,)
    assert sx.tolist() == [1.0, 1.0, 2.0]                                       # a zero row gets scale 1
    assert xq[0].tolist() == [127, 1, 0, 2, -1, 3], "floor(v + 0.5): halves go up (np.rint would give 0, -0, 2, -2)"
    assert xq[1].tolist() == [0] * 6
    assert xq[2].tolist() == [-127, 1, 2, -1, 0, 64]                            # 0.5 -> 1, -1.5 -> -1, 63.5 -> 64


@pytest.mark.exercise("quantize_rows")
@settings(CHECKS, max_examples=30)
@given(st.integers(1, 20), st.integers(1, 200), st.integers(0, 2**32 - 1))
def test_quantize_rows_matches_the_kernel_exactly(T, D, seed):
    """The Numba kernel (kernels.matmul.quantize_rows, fused into RMSNorm in the fast path) must see the very same
    int8 values: a one-step difference would change the W8A8 result. It is tested bit for bit against tinyserve's
    quantize_rows in tests/test_quant.py; here your function against the kernel."""
    x = rand((T, D), seed=seed, scale=float(np.random.default_rng(seed).choice([1e-3, 1.0, 50.0])))
    xq, sx = impl.quantize_rows(x)
    xu, sx_kernel = np.empty((T, D), np.uint8), np.empty(T, np.float32)
    kernels.quantize_rows(x, xu, sx_kernel)
    assert np.array_equal(sx, sx_kernel)
    assert np.array_equal(xq.astype(np.int16), xu.astype(np.int16) - 128)


@pytest.mark.exercise("quantize_rows")
def test_quantize_rows_divides_by_the_scale_near_every_tie():
    """Values within a few float32 steps of every half-step v = (j + 0.5) * sx: there x / sx and x * (127 / amax)
    (the same on paper) round to different float32 numbers, and land on different int8 steps. The kernel divides."""
    rows = []
    for amax in (3.0, 0.7, 11.3):
        sx = np.float32(amax) / np.float32(127)
        half = (np.arange(-126, 126) + 0.5).astype(np.float32) * sx              # the ties, as float32
        near = np.concatenate([half, np.nextafter(half, np.float32(np.inf)), np.nextafter(half, np.float32(-np.inf))])
        rows.append(np.concatenate([[np.float32(amax)], near]).astype(np.float32))
    x = np.stack(rows)                                                           # [3, 1 + 3 * 252]
    xq, sx = impl.quantize_rows(x)
    xu, sx_kernel = np.empty(x.shape, np.uint8), np.empty(len(x), np.float32)
    kernels.quantize_rows(x, xu, sx_kernel)
    assert np.array_equal(sx, sx_kernel)
    bad = np.flatnonzero(xq.astype(np.int16) != xu.astype(np.int16) - 128)
    assert bad.size == 0, (f"{bad.size} values near a tie land on another step than the kernel's floor(x / sx + 0.5) "
                           "(divide by sx: multiplying by 127 / amax rounds differently)")


# --- matmul_reference ----------------------------------------------------------------------------------------------

@pytest.mark.exercise("matmul_reference")
def test_matmul_reference_weight_only_is_x_times_the_dequantised_weights():
    x, w = rand((5, 64), seed=3), rand((64, 32), seed=4)
    q = quant.quantize_weight(w, "int8")
    y = impl.matmul_reference(x, q)
    assert y.shape == (5, 32) and y.dtype == np.float32
    np.testing.assert_allclose(y, x @ q.dequantize(), rtol=1e-5, atol=1e-5)
    assert np.abs(y - x @ w).max() > 0, "the weights are int8 now: not exactly the float32 product"


@pytest.mark.exercise("matmul_reference")
def test_matmul_reference_w8a8_by_hand():
    x = np.array([[2.0, -1.0, 0.5, 0.0]], np.float32)                          # sx = 2 / 127: xq = [127, -63, 32, 0]
    w = np.array([[1.0], [1.0], [-1.0], [0.5]], np.float32)                     # scale 1/127: wq 127, 127, -127, 64
    q = quant.quantize_weight(w, "w8a8")
    acc = 127 * 127 - 63 * 127 - 32 * 127       # -63.5 rounds half up to -63; the sum is an exact integer: 4064
    want = np.float32(acc) * (np.float32(2) / np.float32(127)) * (np.float32(1) / np.float32(127))
    assert impl.matmul_reference(x, q)[0, 0] == want


@pytest.mark.exercise("matmul_reference")
def test_matmul_reference_w8a8_applies_the_scales_in_order():
    """Rows and columns with scales of every size (non-uniform, unlike the cases above): float32 multiplication is
    not associative, so float32(acc) * sx * scale, (float32(acc) * scale) * sx and float32(acc) * (sx * scale) differ
    in the last bit of some outputs, as do scales applied in float64 or inside the sum. The kernels compute the first,
    bit for bit: the reference must too."""
    T, D, O = 24, 192, 48
    x = rand((T, D), seed=8) * (10.0 ** np.random.default_rng(9).uniform(-2, 2, (T, 1))).astype(np.float32)
    w = rand((D, O), seed=10) * (10.0 ** np.random.default_rng(11).uniform(-3, 1, O)).astype(np.float32)
    q = quant.quantize_weight(w, "w8a8")
    xq, sx = quant.quantize_rows(x)
    acc = (xq.astype(np.int64) @ q.wq.astype(np.int64)).astype(np.int32)        # the exact integer sums
    want = (acc.astype(np.float32) * sx[:, None]) * q.scale                      # row scale, then column scale
    got = impl.matmul_reference(x, q)
    bad = int((got != want).sum())
    assert bad == 0, f"{bad} of {want.size} outputs differ from (float32(acc) * sx[t]) * scale[o] (in that order)"


@pytest.mark.exercise("matmul_reference")
def test_matmul_reference_w8a8_sums_exactly_beyond_float32():
    """D = 1536 (SmolLM2's MLP width) with +-127 everywhere: sums up to 24.8 M, beyond float32's 2^24 = 16.7 M
    where a float32 accumulator starts rounding. The integer sum must be exact."""
    D = 1536
    x = np.ones((2, D), np.float32)
    x[1, ::3] = -1.0
    x[1, 0] = 0.9                                                               # 0.9 * 127 = 114.3 -> 114
    w = np.ones((D, 16), np.float32)
    w[7, :] = -0.5                                                              # -63.5 -> -64 (rint: to even)
    q = quant.quantize_weight(w, "w8a8")
    xq, sx = quant.quantize_rows(x)
    acc = xq.astype(np.int64) @ q.wq.astype(np.int64)                           # the exact integers
    assert acc.max() > 2**24 and acc.max() % 2 == 1, "the case must be beyond float32's exact integers"
    want = acc.astype(np.int32).astype(np.float32) * sx[:, None] * q.scale
    assert np.array_equal(impl.matmul_reference(x, q), want)


@pytest.mark.exercise("matmul_reference")
def test_matmul_reference_w8a8_is_exact_in_every_summation_order():
    """A float32 accumulator that rounds only its final sum gives the right answer (the result is float32 anyway),
    so the check above catches one only by the luck of its summation order (it did on one BLAS kernel, not on
    another). Here every exact sum is small (below 2^21, so float32 holds it), but the partial sums are not: the
    products come in long runs of one sign, so any float32 order — one running sum, 4..512 strided lanes, blocks of
    K, pairwise, any OpenBLAS kernel — passes partial sums beyond 2^24 and rounds them."""
    D, O = 2**18, 16              # D * 127 * 127 / 2 < 2^31: the int32 partial sums of one run still fit
    rng = np.random.default_rng(7)
    k = np.arange(D)
    signs = np.stack([np.where(k < D // 2, 1, -1),           # one run each way: caught by sequential sums, blocks
                      np.where(k % 128 < 64, 1, -1),          # one sign along every stride of 128 (128 lanes)
                      np.where(k % 256 < 128, 1, -1)])        # ... and of 256
    x = (rng.integers(100, 128, signs.shape) * signs).astype(np.float32)
    x[:, 0] = 127.0                                           # |max| = 127 in every row: sx = 1, xq = x
    w = rng.integers(100, 128, (D, O)).astype(np.float32)
    w[0] = 127.0                                              # and in every column: scale = 1, wq = w
    q = quant.quantize_weight(w, "w8a8")
    exact = x.astype(np.int64) @ w.astype(np.int64)           # [3, O]
    assert np.abs(exact).max() < 2**21, "the case needs exact sums that float32 holds"
    got = impl.matmul_reference(x, q)
    assert np.array_equal(got, exact.astype(np.float32)), (
        f"off by up to {np.abs(got.astype(np.float64) - exact).max():.0f}: the integer sums must be exact, but "
        "partial sums beyond 2^24 were rounded (a float32 accumulator?)")


# --- pack_vnni -------------------------------------------------------------------------------------------------------

@pytest.mark.exercise("pack_vnni")
def test_pack_vnni_by_hand():
    D, O = 8, 32
    wq = (np.arange(D * O).reshape(D, O) % 251 - 125).astype(np.int8)          # every entry recognisable
    p = impl.pack_vnni(wq)
    assert p.shape == (2, 128) and p.dtype == np.int8
    assert p[0, :8].tolist() == [wq[0, 0], wq[1, 0], wq[2, 0], wq[3, 0], wq[0, 1], wq[1, 1], wq[2, 1], wq[3, 1]]
    assert p[1, 64 + 4 * 15 + 3] == wq[7, 31]                                   # b=1, i=1, l=15, k=3


@pytest.mark.exercise("pack_vnni")
@settings(CHECKS, max_examples=20)
@given(st.integers(1, 24), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_pack_vnni_holds_every_weight_where_the_formula_says(n4, nb, seed):
    D, O = 4 * n4, 16 * nb
    wq = np.random.default_rng(seed).integers(-127, 128, (D, O)).astype(np.int8)
    p = impl.pack_vnni(wq)
    assert p.shape == (nb, n4 * 64)
    i, k, b, l = np.meshgrid(np.arange(n4), np.arange(4), np.arange(nb), np.arange(16), indexing="ij")
    assert np.array_equal(p[b, 64 * i + 4 * l + k], wq[4 * i + k, 16 * b + l])


@pytest.mark.exercise("pack_vnni")
@pytest.mark.parametrize("shape", [(6, 16), (8, 24)])
def test_pack_vnni_refuses_other_shapes(shape):
    with pytest.raises(ValueError):
        impl.pack_vnni(np.zeros(shape, np.int8))


# --- matmul_w8a8 in Numba --------------------------------------------------------------------------------------------

def w8a8_inputs(x: np.ndarray, q: quant.QuantizedLinear):
    """What the kernel takes, made with tinyserve's helpers (so this exercise does not depend on the others)."""
    xq, sx = quant.quantize_rows(x)
    xu = (xq.astype(np.int16) + 128).astype(np.uint8)
    return xu, sx, kernels.pack_vnni(q.wq), q.wq.sum(axis=0, dtype=np.int32), q.scale


@pytest.mark.exercise("matmul_w8a8")
@settings(CHECKS, max_examples=25)
@given(st.integers(1, 12), st.integers(1, 40), st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_matmul_w8a8_is_bit_exact(T, n4, nb, seed):
    x, w = rand((T, 4 * n4), seed=seed), rand((4 * n4, 16 * nb), seed=seed + 1)
    q = quant.quantize_weight(w, "w8a8")
    y = impl.matmul_w8a8(*w8a8_inputs(x, q))
    assert y.shape == (T, 16 * nb) and y.dtype == np.float32
    ref = quant.matmul_reference(x, q)
    assert np.array_equal(y, ref), f"not bit-exact: max diff {np.abs(y - ref).max():.3g} (integer sums, then " \
                                   "float32(acc - 128 * wsum) * sx * sw in that order)"


@pytest.mark.exercise("matmul_w8a8")
def test_matmul_w8a8_large_sums_and_accumulate():
    D, O, T = 1536, 32, 3                                                       # sums beyond 2^24: int32, not float32
    x = rand((T, D), seed=5)
    x[0] = 1.0
    w = np.ones((D, O), np.float32)
    w[::5] = 0.3
    q = quant.quantize_weight(w, "w8a8")
    args = w8a8_inputs(x, q)
    ref = quant.matmul_reference(x, q)
    assert np.array_equal(impl.matmul_w8a8(*args), ref)
    residual = rand((T, O), seed=6)
    out = residual.copy()
    got = impl.matmul_w8a8(*args, out=out, accumulate=True)
    assert got is out, "accumulate into the given buffer (no temporary)"
    assert np.array_equal(out, residual + ref)



# --- smoothing_factors -------------------------------------------------------------------------------------------

@pytest.mark.exercise("smoothing_factors")
def test_smoothing_factors_by_hand():
    x_amax = np.array([4.0, 1.0, 0.0, 9.0, 2.0], np.float32)
    w_amax = np.array([1.0, 4.0, 2.0, 0.0, 8.0], np.float32)
    s = np.asarray(impl.smoothing_factors(x_amax, w_amax, 0.5))
    assert s.shape == (5,) and s.dtype == np.float32
    assert np.isfinite(s).all(), "a channel whose maximum is 0 (channels 2 and 3) must get s = 1, not 0, inf or NaN"
    np.testing.assert_allclose(s, [2.0, 0.5, 1.0, 1.0, 0.5], rtol=1e-6, err_msg=(
        "at alpha = 0.5, s = sqrt(x_amax / w_amax): a large activation range gives a large s (x / s shrinks it), "
        "a large weight range a small one; channels with a zero maximum keep 1"))


@pytest.mark.exercise("smoothing_factors")
@pytest.mark.parametrize("alpha", [0.25, 0.5, 0.8])
def test_smoothing_factors_give_each_side_its_share(alpha):
    """What the factors are for: after x / s and s * W, channel j spans (x_amax w_amax)^(1-alpha) in the activations
    and (x_amax w_amax)^alpha in the weights. Ranges drawn over 4 decades, so that other formulas that agree at
    alpha = 0.5 (e.g. (x_amax / w_amax)^alpha) or on equal ranges give other numbers here."""
    rng = np.random.default_rng(int(alpha * 100))
    x_amax = (10.0 ** rng.uniform(-2, 2, 64)).astype(np.float32)
    w_amax = (10.0 ** rng.uniform(-2, 2, 64)).astype(np.float32)
    s = np.asarray(impl.smoothing_factors(x_amax, w_amax, alpha), np.float64)
    prod = x_amax.astype(np.float64) * w_amax
    np.testing.assert_allclose(x_amax / s, prod ** (1 - alpha), rtol=1e-5, err_msg=(
        f"alpha = {alpha}: the activations' range after smoothing should be (x_amax * w_amax)^(1 - alpha)"))
    np.testing.assert_allclose(w_amax * s, prod ** alpha, rtol=1e-5, err_msg=(
        f"alpha = {alpha}: the weights' range after smoothing should be (x_amax * w_amax)^alpha"))


# --- online_attention: FlashAttention's rule over paged blocks -----------------------------------------------------

def paged_case(ctx, m, *, bs=4, K=2, g=3, H=8, seed=0, spare=3):
    """One sequence of ctx positions in a pool of shuffled blocks (block i of the table is not block i of the pool),
    K = 2 KV heads for N = 6 query heads. The slots past ctx and the blocks it does not own hold large numbers, as a
    real pool holds other sequences' keys: a row that reads them is visibly wrong."""
    rng = np.random.default_rng(seed)
    n_blocks = -(-ctx // bs)
    nb = n_blocks + spare
    k_cache = np.full((nb, bs, K, H), 50.0, np.float32)
    v_cache = np.full((nb, bs, K, H), 1e3, np.float32)
    table = rng.permutation(nb)[:n_blocks]
    k_seq, v_seq = rng.standard_normal((2, ctx, K, H)).astype(np.float32)
    for p in range(ctx):
        k_cache[table[p // bs], p % bs], v_cache[table[p // bs], p % bs] = k_seq[p], v_seq[p]
    q = rng.standard_normal((m, K * g, H)).astype(np.float32)
    return q, k_cache, v_cache, table, k_seq, v_seq


def two_pass(q, k_cache, v_cache, table, ctx):
    """The truth: lesson 4's paged_attention (gather, then lesson 3's grouped attention over all scores at once),
    which the engine runs and tests/test_paged_attention.py checks against the contiguous model."""
    return paged.paged_attention(q, k_cache, v_cache, np.asarray([table]), np.asarray([ctx]), np.asarray([0, len(q)]))


def write(k_cache, v_cache, table, k_seq, v_seq):
    bs = k_cache.shape[1]
    for p in range(len(k_seq)):
        k_cache[table[p // bs], p % bs], v_cache[table[p // bs], p % bs] = k_seq[p], v_seq[p]


@pytest.mark.exercise("online_attention")
@pytest.mark.parametrize("ctx,m", [(1, 1), (23, 1), (23, 7), (22, 22), (16, 3)],
                         ids=["one position", "decode, last block partial", "7 new rows", "prefill", "full blocks"])
def test_online_attention_equals_the_two_pass_reference(ctx, m):
    q, k_cache, v_cache, table, *_ = paged_case(ctx, m, seed=ctx * 10 + m)
    got = np.asarray(impl.online_attention(q, k_cache, v_cache, table, ctx))
    assert got.shape == q.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, two_pass(q, k_cache, v_cache, table, ctx), rtol=1e-4, atol=1e-5, err_msg=(
        "row t is position ctx - m + t and sees positions 0 .. ctx - m + t (itself included); position p lives in "
        "block block_table[p // bs], slot p % bs; the last block holds only ctx - (blocks - 1) * bs positions"))


@pytest.mark.exercise("online_attention")
def test_online_attention_when_the_max_grows_block_after_block():
    """Every block's scores sit ~6 above the previous block's: each block raises the running max, so whatever was
    summed before must be rescaled by exp(m - m'), the sum l and the accumulator acc alike."""
    ctx, m, bs = 21, 2, 4
    q, k_cache, v_cache, table, k_seq, v_seq = paged_case(ctx, m, bs=bs, seed=3)
    u = np.ones(8, np.float32) / np.sqrt(8)
    q[:] = np.sqrt(8) * u                                                       # every head: scale * q.k = k.u
    k_seq = (np.arange(ctx) // bs * 6.0)[:, None, None] * u + 0.3 * k_seq       # block i scores ~6 i
    v_seq = v_seq + (np.arange(ctx) // bs)[:, None, None]                       # each block's V its own level
    write(k_cache, v_cache, table, k_seq, v_seq)
    want = two_pass(q, k_cache, v_cache, table, ctx)
    got = np.asarray(impl.online_attention(q, k_cache, v_cache, table, ctx))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=(
        "when a block raises the max from m to m', the sum l and the accumulator acc both need * exp(m - m')"))


@pytest.mark.exercise("online_attention")
def test_online_attention_with_every_score_far_below_zero():
    """Scores near -200: exp(s - 0) is 0 in float32, so a running max that starts at 0 instead of -inf (or any
    shift that is not the scores' own max) sums nothing and divides 0 by 0."""
    ctx, m = 10, 3
    q, k_cache, v_cache, table, k_seq, v_seq = paged_case(ctx, m, seed=4)
    u = np.ones(8, np.float32) / np.sqrt(8)
    q[:] = -20 * u
    write(k_cache, v_cache, table, 30 * u[None, None, :] + 0.5 * k_seq, v_seq)   # scale * q.k ~ -212
    want = two_pass(q, k_cache, v_cache, table, ctx)
    got = np.asarray(impl.online_attention(q, k_cache, v_cache, table, ctx))
    assert np.isfinite(got).all(), "NaN or inf: the running max must start at -inf and follow the scores"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.exercise("online_attention")
@settings(CHECKS, max_examples=25)
@given(st.integers(1, 40), st.integers(1, 8), st.sampled_from([(1, 1), (1, 4), (2, 3), (3, 1)]), st.data())
def test_online_attention_on_random_layouts(ctx, bs, heads, data):
    m = data.draw(st.integers(1, ctx))
    K, g = heads
    q, k_cache, v_cache, table, *_ = paged_case(ctx, m, bs=bs, K=K, g=g, seed=ctx * 1000 + bs * 10 + m)
    got = np.asarray(impl.online_attention(q, k_cache, v_cache, table, ctx))
    np.testing.assert_allclose(got, two_pass(q, k_cache, v_cache, table, ctx), rtol=1e-4, atol=1e-5)


@pytest.mark.exercise("online_attention")
@pytest.mark.parametrize("ctx,m,blocks", [(9, 1, 2), (3, 4, 1)], ids=["table too short", "more rows than positions"])
def test_online_attention_refuses_what_it_cannot_attend(ctx, m, blocks):
    rng = np.random.default_rng(0)
    pool = rng.standard_normal((4, 4, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError):
        impl.online_attention(rng.standard_normal((m, 6, 8)).astype(np.float32), pool, pool, np.arange(blocks), ctx)
