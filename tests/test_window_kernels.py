"""Lesson 11 on the numba backend: the paged attention kernels mask by a sliding window.

The truth is paged.paged_attention with its window (the NumPy reference, itself checked against a dense
row-by-row reference in tests/test_sliding_window.py): the kernels must match it within the kernels' tolerance
(rtol 1e-4 / atol 1e-5, as tests/test_kernels.py), read no freed block (-1 before the window), and keep
key_chunks' rule: a row's bits are the same as a prefill row or as a decode row, alone or beside other sequences.
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyserve.kernels.attention import paged_attention_numba
from tinyserve.kv_sizing import blocks_for, first_live_block
from tinyserve.paged import paged_attention


def case(seed, ctxs, ms, window, bs=4, K=1, N=4, H=32, spare=3):
    """A pool holding B sequences (shuffled blocks), their tables with the blocks behind each first new row's
    window freed (-1), q of their new rows, context_lens and query_starts."""
    rng = np.random.default_rng(seed)
    need = [blocks_for(c, bs) for c in ctxs]
    nb = sum(need) + spare
    k_cache = rng.standard_normal((nb, bs, K, H)).astype(np.float32)
    v_cache = rng.standard_normal((nb, bs, K, H)).astype(np.float32)
    ids = rng.permutation(nb)
    tables = np.full((len(ctxs), max(need)), -1, np.int64)
    at = 0
    for b, (c, m) in enumerate(zip(ctxs, ms)):
        tables[b, :need[b]] = ids[at:at + need[b]]
        at += need[b]
        if window is not None:
            tables[b, :first_live_block(c - m, window, bs)] = -1        # the block manager released them
    q = rng.standard_normal((sum(ms), N, H)).astype(np.float32)
    return q, k_cache, v_cache, tables, np.array(ctxs, np.int64), np.concatenate([[0], np.cumsum(ms)]).astype(np.int64)


@pytest.mark.parametrize("window, ctxs, ms", [
    (8, [29], [1]), (8, [29], [11]), (8, [29, 5, 40], [1, 1, 1]), (8, [29, 17, 40], [3, 17, 1]),
    (100, [300], [1]), (100, [300], [37]), (70, [64, 65, 129, 300], [1, 1, 1, 1]), (70, [200, 90], [150, 20]),
    (512, [300], [300]), (1, [20], [5])])
def test_windowed_kernel_matches_the_numpy_reference(window, ctxs, ms):
    args = case(len(ctxs) + sum(ms), ctxs, ms, window)
    want = paged_attention(*args, window=window)
    got = paged_attention_numba(*args, window=window)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("H, K, N", [(256, 1, 4), (16, 2, 4), (24, 1, 2)])
def test_windowed_kernel_at_gemma_shapes_and_untiled_heads(H, K, N):
    """Gemma 3's one K/V head of 256 dims; also a head_dim that is not a multiple of 16 (the untiled loops)."""
    args = case(7, [150, 90, 40], [1, 1, 1], 70, bs=16, K=K, N=N, H=H)
    np.testing.assert_allclose(paged_attention_numba(*args, window=70), paged_attention(*args, window=70),
                               rtol=1e-4, atol=1e-5)
    args = case(8, [150, 90], [40, 90], 70, bs=16, K=K, N=N, H=H)
    np.testing.assert_allclose(paged_attention_numba(*args, window=70), paged_attention(*args, window=70),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("K, N, H", [(1, 4, 32), (1, 4, 256), (2, 8, 48), (1, 2, 24)])
def test_a_row_has_the_same_bits_as_prefill_or_decode_alone_or_batched(K, N, H):
    """key_chunks' rule with a window: one sequence's last row, computed as the last row of a prefill chunk, as a
    decode row alone, and as a decode row beside two other sequences, gives the same bits; and so does every row of
    the prefill chunk against a decode row at its position (prefill rows on the decode rows' microkernels; H = 24:
    the untiled loops)."""
    window, ctx, m = 70, 200, 37
    q, kc, vc, table, lens, starts = case(3, [ctx], [m], window, bs=4, K=K, N=N, H=H)
    rows = paged_attention_numba(q, kc, vc, table, lens, starts, window=window)
    prefill = rows[-1]
    alone = paged_attention_numba(q[-1:], kc, vc, table, lens, np.array([0, 1]), window=window)[0]
    assert np.array_equal(prefill, alone)
    for i in range(0, m, 6):                         # row i sits at position ctx - m + i: a decode row there
        tb = table.copy()
        tb[0, :first_live_block(ctx - m + i, window, 4)] = -1
        one = paged_attention_numba(q[i:i + 1], kc, vc, tb, np.array([ctx - m + i + 1]), np.array([0, 1]),
                                    window=window)[0]
        assert np.array_equal(rows[i], one), f"prefill row {i} differs from the decode row at its position"
    # two more sequences share the pool's blocks (read-only: any blocks serve), before and after this one
    others = np.random.default_rng(4).standard_normal((2,) + q.shape[1:]).astype(np.float32)
    qb = np.stack([others[0], q[-1], others[1]])
    tb = np.stack([table[0], table[0], table[0]])
    tb[0, :] = np.where(tb[0] < 0, 0, tb[0])
    batched = paged_attention_numba(qb, kc, vc, tb, np.array([90, ctx, ctx]), np.arange(4), window=window)[1]
    assert np.array_equal(batched, alone)


def test_a_window_that_does_not_bind_changes_no_bit():
    """window >= context: the windowed kernel adds the very terms the global one does, in the same order."""
    args = case(5, [100, 60], [1, 1], None)
    assert np.array_equal(paged_attention_numba(*args, window=500), paged_attention_numba(*args))
    args = case(6, [100, 60], [30, 60], None)
    assert np.array_equal(paged_attention_numba(*args, window=500), paged_attention_numba(*args))


def test_the_contiguous_cache_window_attention_is_a_paged_row():
    """kv_cache's windowed layers on the numba backend (dense_attention.window_attention): the reference's result,
    and the same bits as the paged kernel gives the same rows."""
    from tinyserve.kernels.dense_attention import window_attention
    from tinyserve.kv_cache import rectangular_attention
    rng = np.random.default_rng(9)
    S, m, window = 150, 20, 70
    k, v = (rng.standard_normal((S, 1, 32)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((m, 4, 32)).astype(np.float32)
    got = window_attention(q, k, v, window)
    np.testing.assert_allclose(got, rectangular_attention(q, k, v, window), rtol=1e-4, atol=1e-5)
    table = np.arange(blocks_for(S, 2))[None]                        # the same keys as blocks of 2
    paged = paged_attention_numba(q, k.reshape(-1, 2, 1, 32), v.reshape(-1, 2, 1, 32), table, np.array([S]),
                                  np.array([0, m]), window=window)
    assert np.array_equal(got, paged)
    assert np.array_equal(window_attention(q[-1:], k, v, window), got[-1:])      # a decode row alone


@pytest.mark.parametrize("S, m, H", [(150, 150, 32), (300, 40, 256), (90, 3, 256)])
def test_a_contiguous_window_that_does_not_bind_is_the_paged_row(S, m, H):
    """window >= S: window_attention runs the row-tiled causal kernel (a prefill's), which must give the bits the
    paged kernel gives the same rows with the window, at a prefill's row counts and at Gemma's head size."""
    from tinyserve.kernels.dense_attention import window_attention
    rng = np.random.default_rng(S + m)
    k, v = (rng.standard_normal((S, 1, H)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((m, 4, H)).astype(np.float32)
    table = np.arange(blocks_for(S, 2))[None]
    paged = paged_attention_numba(q, k.reshape(-1, 2, 1, H), v.reshape(-1, 2, 1, H), table, np.array([S]),
                                  np.array([0, m]), window=S)
    assert np.array_equal(window_attention(q, k, v, S), paged)
    assert np.array_equal(window_attention(q, k, v, S + 100), paged)
