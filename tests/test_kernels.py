"""The Numba paged attention kernel gives the NumPy reference's answer, and the kernels package sets up Numba; the
matmuls' one work split (matmul.thread_share, matmul_blocks) puts every kind's matmul together from threads' shares.

Tolerance: rtol 1e-4, atol 1e-5 against the reference. Both compute in float32, but in a different order (an
online softmax over chunks of 64 keys, kernels/key_chunks.py's rule, instead of BLAS on a gathered copy);
observed differences are ~1e-6 on these O(1) outputs.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_info

import tinyserve as ts
from tinyserve import kernels
from tinyserve.kernels.attention import paged_attention_numba
from tinyserve.attention_backends import get_paged_attention
from tinyserve.paged import KVPool, paged_attention, slot_mapping, write_kv

from .test_paged_attention import CASES, make_batch

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_numba_matches_numpy(case, block_size):
    batch = make_batch(CASES[case], block_size, seed=block_size)
    out = paged_attention_numba(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, paged_attention(*batch.args()), **TOL)
    np.testing.assert_allclose(out, batch.expected, **TOL)


@pytest.mark.parametrize("seed", [0, 1])
def test_long_contexts_over_many_chunks(seed):
    """Contexts of many key chunks, prefill rows crossing chunk boundaries, and one decode row, in one batch."""
    seqs = [(600, 1), (300, 7), (257, 257), (40, 1)]
    for block_size in (4, 16):
        batch = make_batch(seqs, block_size, H=64, seed=seed)
        out = paged_attention_numba(*batch.args())
        np.testing.assert_allclose(out, batch.expected, **TOL)


@st.composite
def batches(draw):
    """Random batches: 1-4 sequences, each with some history and 1..40 new rows, any block size."""
    seqs = []
    for _ in range(draw(st.integers(1, 4))):
        m = draw(st.integers(1, 40))
        seqs.append((m + draw(st.integers(0, 150)), m))
    return seqs, draw(st.sampled_from([1, 3, 16])), draw(st.integers(0, 10**6))


@settings(max_examples=40, deadline=None)
@given(batches())
def test_numba_matches_contiguous_on_random_batches(case):
    seqs, block_size, seed = case
    batch = make_batch(seqs, block_size, H=8, seed=seed)
    np.testing.assert_allclose(paged_attention_numba(*batch.args()), batch.expected, **TOL)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 700), min_size=1, max_size=6), st.sampled_from([1, 5, 16]),
       st.sampled_from([(4, 4), (9, 3), (8, 1)]), st.integers(0, 10**6))
def test_decode_steps_take_the_decode_kernel_and_match(ctxs, block_size, heads, seed):
    """A batch of one new row per sequence (T == B) runs _paged_decode_kernel: same answers as the reference."""
    N, K = heads
    batch = make_batch([(c, 1) for c in ctxs], block_size, N=N, K=K, H=32, seed=seed)
    np.testing.assert_allclose(paged_attention_numba(*batch.args()), batch.expected, **TOL)


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (9, 3), (8, 1)])
def test_numba_gqa_group_sizes(N, K):
    batch = make_batch([(30, 1), (19, 5)], block_size=4, N=N, K=K, H=24)   # H not a multiple of 8 either
    np.testing.assert_allclose(paged_attention_numba(*batch.args()), batch.expected, **TOL)


def test_large_scores_do_not_overflow():
    # the running max keeps exp() in range even when raw scores are huge (softmax -> one-hot)
    batch = make_batch([(100, 3)], block_size=16)
    big = batch.q * 300
    np.testing.assert_allclose(paged_attention_numba(big, *batch.args()[1:]),
                               paged_attention(big, *batch.args()[1:]), **TOL)
    assert np.isfinite(paged_attention_numba(big, *batch.args()[1:])).all()


def test_non_contiguous_and_other_dtypes_are_accepted():
    batch = make_batch([(20, 4), (9, 1)], block_size=4)
    q_strided = np.concatenate([batch.q, batch.q], axis=2)[:, :, ::2]       # a strided view of other values
    q_strided[...] = batch.q
    tables64 = batch.block_tables.astype(np.int64)
    out = paged_attention_numba(q_strided, batch.k_cache, batch.v_cache, tables64, list(batch.context_lens),
                                batch.query_starts.astype(np.int32))
    np.testing.assert_allclose(out, batch.expected, **TOL)


def test_numba_backend_inside_the_model(tiny):
    """Prefill + decode of the tiny model through a KVPool: numba backend == numpy backend."""
    cfg, bs = tiny.config, 4
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, 10)
    table = np.array([[3, 0, 5]], np.int32)
    results = {}
    for backend in ("numpy", "numba"):
        attn, pool, logits = get_paged_attention(backend), KVPool.create(cfg, 6, bs), []
        for start, count in [(0, 6), (6, 1), (7, 3)]:
            slots = slot_mapping(table[0], start, count, bs)

            def attention(layer, q, k, v):
                write_kv(pool.k[layer], pool.v[layer], slots, k, v)
                return attn(q, pool.k[layer], pool.v[layer], table, [start + count], [0, count])
            with kernels.single_thread_blas():
                logits.append(ts.forward(tiny, tokens[start:start + count], np.arange(start, start + count), attention))
        results[backend] = np.concatenate(logits)
    np.testing.assert_allclose(results["numba"], results["numpy"], rtol=1e-4, atol=1e-4)


def test_kernels_package_setup():
    assert get_paged_attention("numba") is paged_attention_numba
    import numba
    assert numba.config.CACHE_DIR, "importing tinyserve.kernels must set a cache dir for cache=True"
    paged_attention_numba(*make_batch([(5, 1)], 4).args())     # a parallel call has run: the layer is known
    assert kernels.check_threading_layer() in ("omp", "tbb", "workqueue")


def test_single_thread_blas_limits_and_restores():
    def blas_threads():
        return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    before = blas_threads()
    assert before, "threadpoolctl sees no BLAS library under numpy"
    with kernels.single_thread_blas():
        assert blas_threads() == [1] * len(before)
    assert blas_threads() == before


def test_workqueue_threading_layer_warns_loudly(monkeypatch):
    monkeypatch.setattr(kernels.numba, "threading_layer", lambda: "workqueue")
    monkeypatch.setattr(kernels, "_threading_checked", False)
    with pytest.warns(RuntimeWarning, match="workqueue"):
        assert kernels.check_threading_layer() == "workqueue"


# --- the contiguous-cache attention kernel (kv_cache on the numba backend, prefill rows) ---------------------------

@st.composite
def dense_cases(draw):
    """m new rows after S0 cached ones, GQA shapes with head_dim a multiple of 16, scores of several scales."""
    K = draw(st.sampled_from([1, 2, 3]))
    return (draw(st.integers(1, 70)), draw(st.integers(0, 200)), K * draw(st.sampled_from([1, 2, 3])), K,
            draw(st.sampled_from([16, 32, 64])), draw(st.sampled_from([0.3, 1.0, 3.0])), draw(st.integers(0, 10**6)))


@settings(max_examples=40, deadline=None)
@given(dense_cases())
def test_dense_attention_kernel_matches_grouped_attention(case):
    from tinyserve.gqa import grouped_attention
    from tinyserve.kernels.dense_attention import causal_attention
    m, S0, N, K, H, scale, seed = case
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((m, N, H)) * scale).astype(np.float32)
    k = (rng.standard_normal((S0 + m, K, H)) * scale).astype(np.float32)
    v = rng.standard_normal((S0 + m, K, H)).astype(np.float32)
    np.testing.assert_allclose(causal_attention(q, k, v), grouped_attention(q, k, v), **TOL)


def test_dense_attention_kernel_all_negative_and_huge_scores():
    """The row max is taken over the floats' bits as ordered integers: negative rows (max near 0 from below) and
    huge scores (a one-hot softmax) must come out as in the reference, and finite."""
    from tinyserve.gqa import grouped_attention
    from tinyserve.kernels.dense_attention import causal_attention
    rng = np.random.default_rng(7)
    q = np.abs(rng.standard_normal((40, 4, 16))).astype(np.float32)
    k = -np.abs(rng.standard_normal((60, 2, 16))).astype(np.float32)          # every score < 0
    v = rng.standard_normal((60, 2, 16)).astype(np.float32)
    for qs in (q, q * 60):                                                     # scores up to ~1e4: one-hot rows
        got = causal_attention(qs, k, v)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, grouped_attention(qs, k, v), **TOL)


def test_float_bits_round_trip():
    from numba import njit
    from tinyserve.kernels.simd import bits_float, float_bits
    both = njit(lambda x: (float_bits(x), bits_float(float_bits(x))))
    for x in (0.0, -0.0, 1.0, -2.5, 3.4e38, 1e-45):
        b, back = both(np.float32(x))
        assert b == np.array([x], np.float32).view(np.int32)[0] and back == np.float32(x)


@pytest.mark.parametrize("n", [1, 7, 8, 9, 127, 128, 129, 200, 576, 1000, 1536])
def test_pairwise_sum_adds_a_float32_run_exactly_as_numpy(n):
    """kernels/layer.py's RMSNorm sums squares with NumPy's own pairwise tree (blocks of 128, 8 running sums) so
    that the W8A8 fast path stays the NumPy reference bit for bit. From 8 elements on the tree's order shows: on
    these rows a plain running sum differs from NumPy's at n = 8 and from 127 on (below 8 both add in order)."""
    from tinyserve.kernels.layer import _pairwise_sum
    rng = np.random.default_rng(n)
    a = (rng.standard_normal(n + 3) * rng.uniform(0.01, 100, n + 3)).astype(np.float32)   # non-uniform scales
    for lo in (0, 3):
        assert _pairwise_sum(a, lo, n) == np.add.reduce(a[lo:lo + n]), f"n={n}, offset {lo}"


# --- the matmuls' one work split (kernels/matmul.py) ----------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(n=st.integers(0, 300), n_threads=st.integers(1, 9))
def test_thread_share_gives_every_unit_to_one_thread_in_order(n, n_threads):
    from tinyserve.kernels.matmul import thread_share
    parts = [thread_share(n, t, n_threads) for t in range(n_threads)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), parts        # neighbours, no gap, no overlap
    assert max(hi - lo for lo, hi in parts) - min(hi - lo for lo, hi in parts) <= 1


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), cut=st.tuples(st.integers(0, 300), st.integers(0, 300)), n_threads=st.integers(1, 9),
       costs=st.sampled_from([(1, 1), (1, 2), (2, 3), (3, 1)]))
def test_weighted_share_gives_every_unit_to_one_thread_and_evens_the_cost(n, cut, n_threads, costs):
    """A decode thread's share of gate|up when the up half's blocks also multiply a second plane: every block to
    one thread, in order, and each thread's cost within one block's cost of an even split (equal costs, or no
    second-plane blocks: thread_share's counts)."""
    from tinyserve.kernels.matmul import thread_share, weighted_share
    lo, hi = sorted(min(c, n) for c in cut)
    parts = [weighted_share(n, lo, hi, *costs, t, n_threads) for t in range(n_threads)]
    assert parts[0][0] == 0 and parts[-1][1] == n
    assert all(a[1] == b[0] and a[0] <= a[1] for a, b in zip(parts, parts[1:] + [(n, n)])), parts
    cost = lambda a, b: sum(costs[1] if lo <= u < hi else costs[0] for u in range(a, b))        # noqa: E731
    total = cost(0, n)
    assert all(abs(cost(a, b) * n_threads - total) < max(costs) * n_threads for a, b in parts), (parts, total)
    if costs[0] == costs[1] or lo == hi:
        assert parts == [thread_share(n, t, n_threads) for t in range(n_threads)]


def _packed_kinds(T: int, D: int, O: int, seed: int):
    """kind -> (its packed weights, the float rows x [T, D], the quantised rows xu and their scales sx, the whole
    matmul through its public entry), for one random matrix of each kind."""
    from tinyserve import quant
    from tinyserve.kernels import matmul as mm
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, D)).astype(np.float32)
    w = rng.standard_normal((D, O)).astype(np.float32)
    out = {}
    q8 = quant.quantize_weight(w, "w8a8-64")
    xq, sx = quant.quantize_blocks(x, D // 64)
    xu = (xq.astype(np.int16) + 128).astype(np.uint8)
    wt = mm.W8A8Weights(mm.pack_vnni(q8.wq), mm.block_sums(q8.wq, D // 64), q8.scale)
    out["w8a8"] = wt, x, xu, sx, mm.matmul_w8a8(xu, sx, wt.w, mm.block_sums(q8.wq, D // 64), wt.scale)
    wt = mm.W8A32Weights(mm.pack_w8a32(q8.wq), mm.block_sums(q8.wq, 1), q8.scale)
    out["w8a32"] = wt, x, xu, np.ones((T, 1), np.float32), mm.matmul_w8a32(x, wt.w, wt.scale)
    q4 = quant.quantize_q4_1(w)
    xq, sx = quant.quantize_blocks(x, D // 32)
    xu = (xq.astype(np.int16) + 128).astype(np.uint8)
    wt = mm.w4a8_weights(mm.pack_w4a8(q4.q, q4.d, q4.m))
    out["w4a8"] = wt, x, xu, sx, mm.matmul_w4a8(xu, sx, wt.w)
    wt = mm.s4a8_weights(mm.pack_s4a8(q4.q, q4.d))          # the symmetric nibble tile (its m is -8 d, not q4.m)
    out["s4a8"] = wt, x, xu, sx, mm.matmul_w4a8(xu, sx, wt.w)
    return out


@pytest.mark.parametrize("T, D, O", [(1, 128, 48), (5, 192, 160), (16, 64, 16)])
def test_every_kind_split_over_threads_is_the_whole_matmul(T, D, O):
    """The fused decode step's threads each run matmul_blocks on their thread_share of the output blocks; put
    together, the shares are the parallel matmul (matmul_items) bit for bit, for every kind of packed weights."""
    from tinyserve.kernels import matmul as mm
    for kind, (wt, x, xu, sx, whole) in _packed_kinds(T, D, O, seed=T).items():
        for n_threads in (1, 2, 3):
            parts = np.full((T, O), np.nan, np.float32)
            for tid in range(n_threads):
                lo, hi = mm.thread_share(O // 16, tid, n_threads)
                mm.matmul_blocks(wt, x, xu, sx, parts, False, lo, hi, np.empty(mm.ROWS * mm.COLS * 16, np.float32))
            assert np.array_equal(parts, whole), f"{kind}, {n_threads} threads: max {np.nanmax(np.abs(parts - whole))}"


def test_a_matmul_refuses_weights_that_are_not_a_packed_kind():
    """The kind is declared by the weights' class, never guessed from a shape: a bare tuple of the same arrays is
    refused, naming the kinds."""
    from tinyserve.kernels import matmul as mm
    wt, x, xu, sx, _ = _packed_kinds(1, 64, 16, seed=0)["w8a8"]
    with pytest.raises(Exception,
                       match="W8A8Weights, W8A32Weights, W4A8Weights, S4A8Weights, Q6A8Weights, B8A8Weights, "
                             "S8A8Weights, Q5A8Weights or S5A8Weights"):
        mm.matmul_blocks(tuple(wt), x, xu, sx, np.zeros((1, 16), np.float32), False, 0, 1,
                         np.empty(mm.ROWS * mm.COLS * 16, np.float32))


# --- key_chunks.lane_sum: the rule's chunk sum, in LLVM IR --------------------------------------------------------

def _lane_sum_reference(x: np.ndarray) -> np.float32:
    """The order key_chunks.lane_sum documents, one float32 add at a time: lane i adds x[i], x[i + 16], ... from 0,
    then lane i + 8 folds onto lane i, then i + 4, i + 2, i + 1."""
    lanes = [np.float32(0.0)] * 16
    for j, v in enumerate(x):
        lanes[j % 16] = np.float32(lanes[j % 16] + v)
    half = 8
    while half:
        lanes = [np.float32(lanes[i] + lanes[(i + half) % 16]) for i in range(16)]
        half //= 2
    return lanes[0]


def test_lane_sum_adds_in_its_documented_order():
    from numba import njit
    from tinyserve.kernels.key_chunks import lane_sum

    @njit
    def row_slice(p, r, lo, n):                   # how dense_attention passes a chunk: a slice of a row
        return lane_sum(p[r, lo:lo + n], n)

    rng = np.random.default_rng(0)
    p = (rng.standard_normal((3, 260)) * 10.0 ** rng.integers(-20, 20, (3, 260))).astype(np.float32)
    p[0, 5] = -0.0
    for n in (0, 1, 15, 16, 17, 31, 64, 100, 200):
        for lo in (0, 3, 60):
            got = row_slice(p, 1, lo, n)
            assert np.float32(got).tobytes() == _lane_sum_reference(p[1, lo:lo + n]).tobytes(), (n, lo)
    # the elements past n are never read into the sum, whatever they hold
    q = p.copy()
    q[1, 40:] = np.nan
    assert row_slice(q, 1, 0, 40) == _lane_sum_reference(p[1, :40])


def test_lane_sum_refuses_a_strided_array():
    from numba import njit
    from tinyserve.kernels.key_chunks import lane_sum

    @njit
    def column(p):                                # a column: stride of a whole row, which lane_sum cannot follow
        return lane_sum(p[:, 0], p.shape[0])

    with pytest.raises(TypeError, match="C-contiguous"):
        column(np.zeros((4, 8), np.float32))
