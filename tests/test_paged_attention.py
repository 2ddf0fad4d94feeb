"""Paged KV storage and paged attention (NumPy reference) against contiguous grouped attention.

The truth: for every sequence, gqa.grouped_attention on its K/V laid out contiguously. Paged attention must
give the same answer however the blocks are scattered in the pool, whatever the block size, for decode
(m = 1), chunked prefill (m > 1 after some history) and plain prefill, with all sequences in one batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

import tinyserve as ts
from tinyserve.gqa import grouped_attention
from tinyserve.attention_backends import check_block_tables, get_paged_attention
from tinyserve.paged import KVPool, paged_attention, slot_mapping, write_kv


@dataclass
class PagedBatch:
    q: np.ndarray             # [T, N, H]
    k_cache: np.ndarray       # [num_blocks, bs, K, H]
    v_cache: np.ndarray
    block_tables: np.ndarray  # [B, max_blocks] int32, -1 padded
    context_lens: np.ndarray  # [B]
    query_starts: np.ndarray  # [B+1]
    expected: np.ndarray      # [T, N, H] from contiguous grouped attention

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.context_lens, self.query_starts


def make_batch(seqs: list[tuple[int, int]], block_size: int, N: int = 9, K: int = 3, H: int = 16,
               seed: int = 0, spare_blocks: int = 3, extra_table_cols: int = 1) -> PagedBatch:
    """seqs: (context_len, new rows m) per sequence. Blocks are handed out in a scrambled order and the pool
    has spare blocks filled with junk, so only a correct walk of the block table finds the right K/V."""
    rng = np.random.default_rng(seed)
    nblocks = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(nblocks) + spare_blocks
    k_cache = rng.standard_normal((num_blocks, block_size, K, H)).astype(np.float32) * 5  # junk everywhere
    v_cache = rng.standard_normal((num_blocks, block_size, K, H)).astype(np.float32) * 5
    ids = rng.permutation(num_blocks)
    tables = np.full((len(seqs), max(nblocks) + extra_table_cols), -1, np.int32)
    qs, expected, starts = [], [], [0]
    for b, (ctx, m) in enumerate(seqs):
        table, ids = ids[:nblocks[b]], ids[nblocks[b]:]
        tables[b, :len(table)] = table
        k = rng.standard_normal((ctx, K, H)).astype(np.float32)
        v = rng.standard_normal((ctx, K, H)).astype(np.float32)
        write_kv(k_cache, v_cache, slot_mapping(table, 0, ctx, block_size), k, v)
        q = rng.standard_normal((m, N, H)).astype(np.float32)
        qs.append(q)
        expected.append(grouped_attention(q, k, v))
        starts.append(starts[-1] + m)
    return PagedBatch(np.concatenate(qs), k_cache, v_cache, tables, np.array([c for c, _ in seqs]),
                      np.array(starts), np.concatenate(expected))


# (context_len, m) per sequence: decode, chunked prefill with history, plain prefill, block-boundary lengths
CASES = {
    "single_decode": [(37, 1)],
    "single_prefill": [(23, 23)],
    "single_chunk": [(40, 7)],
    "decode_batch": [(1, 1), (16, 1), (17, 1), (50, 1), (3, 1)],
    "mixed": [(33, 1), (20, 20), (48, 16), (5, 2), (64, 1)],
}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_matches_contiguous(case, block_size):
    batch = make_batch(CASES[case], block_size, seed=block_size)
    out = paged_attention(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, batch.expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (9, 3), (8, 1)])
def test_paged_gqa_group_sizes(N, K):
    batch = make_batch([(30, 1), (19, 5)], block_size=4, N=N, K=K)
    np.testing.assert_allclose(paged_attention(*batch.args()), batch.expected, rtol=1e-5, atol=1e-6)


def test_order_of_sequences_does_not_matter():
    # each sequence's output depends only on its own rows and blocks
    seqs = [(33, 1), (20, 4), (9, 9)]
    batch = make_batch(seqs, 4)
    out = paged_attention(*batch.args())
    for b in range(3):
        lo, hi = batch.query_starts[b], batch.query_starts[b + 1]
        alone = paged_attention(batch.q[lo:hi], batch.k_cache, batch.v_cache, batch.block_tables[b:b + 1],
                                batch.context_lens[b:b + 1], np.array([0, hi - lo]))
        np.testing.assert_array_equal(out[lo:hi], alone)


def test_slot_mapping_and_write_kv_round_trip():
    bs, K, H = 4, 2, 8
    pool = np.zeros((6, bs, K, H), np.float32)
    vpool = np.zeros_like(pool)
    table = [5, 0, 3]                                          # logical block i -> physical block table[i]
    np.testing.assert_array_equal(slot_mapping(table, 0, 10, bs),
                                  [20, 21, 22, 23, 0, 1, 2, 3, 12, 13])
    np.testing.assert_array_equal(slot_mapping(table, 6, 3, bs), [2, 3, 12])   # a chunk that crosses a block
    assert slot_mapping(table, 7, 0, bs).shape == (0,)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((10, K, H)).astype(np.float32)
    v = rng.standard_normal((10, K, H)).astype(np.float32)
    # write in two chunks (prefill 6, then 4 more), as the engine would
    write_kv(pool, vpool, slot_mapping(table, 0, 6, bs), k[:6], v[:6])
    write_kv(pool, vpool, slot_mapping(table, 6, 4, bs), k[6:], v[6:])
    np.testing.assert_array_equal(pool[table].reshape(-1, K, H)[:10], k)
    np.testing.assert_array_equal(vpool[table].reshape(-1, K, H)[:10], v)
    assert not pool[[1, 2, 4]].any() and not pool[3, 2:].any()    # nothing else was touched
    # a non-contiguous cache (a strided view) is written through, not into a temporary copy
    strided = np.zeros((K, H, bs, 6), np.float32).transpose(3, 2, 0, 1)   # [6, bs, K, H] view
    write_kv(strided, strided.copy(), slot_mapping(table, 0, 10, bs), k, v)
    np.testing.assert_array_equal(strided[table].reshape(-1, K, H)[:10], k)


def test_kv_pool_create(tiny):
    cfg = tiny.config
    pool = KVPool.create(cfg, num_blocks=10, block_size=8)
    shape = (cfg.n_layers, 10, 8, cfg.n_kv_heads, cfg.head_dim)
    assert pool.k.shape == pool.v.shape == shape and pool.k.dtype == np.float32
    assert pool.nbytes == 2 * 4 * int(np.prod(shape)) and pool.num_blocks == 10 and pool.block_size == 8
    assert pool.k[0].flags.c_contiguous     # write_kv relies on a layer reshaping to a view
    with pytest.raises(ValueError, match="num_blocks"):
        KVPool.create(cfg, num_blocks=0)


def test_paged_attention_inside_the_model(tiny):
    """The tiny model run as prefill + decode steps through a KVPool gives the same logits as one forward."""
    cfg, bs = tiny.config, 4
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 11)
    full = ts.forward(tiny, tokens, np.arange(11), lambda layer, q, k, v: grouped_attention(q, k, v))
    pool = KVPool.create(cfg, num_blocks=8, block_size=bs)
    table = np.array([[6, 1, 4, -1]], np.int32)
    logits = []
    for start, count in [(0, 7), (7, 1), (8, 3)]:              # prefill 7, decode 1, then a chunk of 3
        slots = slot_mapping(table[0], start, count, bs)

        def attention(layer, q, k, v):
            write_kv(pool.k[layer], pool.v[layer], slots, k, v)
            return paged_attention(q, pool.k[layer], pool.v[layer], table, np.array([start + count]),
                                   np.array([0, count]))
        logits.append(ts.forward(tiny, tokens[start:start + count], np.arange(start, start + count), attention))
    np.testing.assert_allclose(np.concatenate(logits), full, rtol=1e-4, atol=1e-4)


def _bad(batch: PagedBatch, **change):
    args = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache, block_tables=batch.block_tables,
                context_lens=batch.context_lens, query_starts=batch.query_starts)
    args.update(change)
    return args


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_bad_input_errors(backend):
    attn = get_paged_attention(backend)
    batch = make_batch([(9, 1), (6, 2)], block_size=4, extra_table_cols=0)   # tables exactly 3 blocks wide
    short = batch.block_tables[:, :2]                                        # 8 positions < context 9
    with pytest.raises(ValueError, match="block table"):
        attn(**_bad(batch, block_tables=short))
    with pytest.raises(ValueError, match="block table"):
        attn(**_bad(batch, context_lens=np.array([9, 13])))                  # 13 positions need a 4th block
    holes = batch.block_tables.copy()
    holes[0, 1] = -1
    with pytest.raises(ValueError, match="block table"):
        attn(**_bad(batch, block_tables=holes))
    with pytest.raises(ValueError, match="query_starts"):
        attn(**_bad(batch, query_starts=np.array([0, 1, 2])))
    with pytest.raises(ValueError, match="context_len"):
        attn(**_bad(batch, context_lens=np.array([9, 1])))                  # 2 new rows but 1 position
    with pytest.raises(ValueError, match="KV heads"):
        attn(**_bad(batch, q=batch.q[:, :, :8]))                            # head_dim mismatch


@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_unchecked_variant_is_the_same_computation(backend):
    # what the engine calls once per layer, after checking the step's batch once with check_block_tables
    batch = make_batch(CASES["mixed"], block_size=4)
    tables, ctx, starts = (np.ascontiguousarray(a, dtype=np.int64)
                           for a in (batch.block_tables, batch.context_lens, batch.query_starts))
    check_block_tables(tables, ctx, starts, len(batch.q), batch.k_cache.shape[0], 4)
    out = get_paged_attention(backend, checked=False)(batch.q, batch.k_cache, batch.v_cache, tables, ctx, starts)
    np.testing.assert_array_equal(out, get_paged_attention(backend)(*batch.args()))
    with pytest.raises(ValueError, match="block table"):
        check_block_tables(tables[:, :2], ctx, starts, len(batch.q), batch.k_cache.shape[0], 4)


def test_slot_mapping_and_write_kv_errors():
    with pytest.raises(ValueError, match="not allocated"):
        slot_mapping([3, 1], 6, 3, 4)                    # position 8 needs a third block
    with pytest.raises(ValueError, match="not allocated"):
        slot_mapping([3, -1], 2, 4, 4)                   # the padding -1 is not a block
    pool = np.zeros((2, 4, 1, 2), np.float32)
    with pytest.raises(ValueError, match="slots"):
        write_kv(pool, pool.copy(), np.array([8]), np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match=r"\[T=2"):
        write_kv(pool, pool.copy(), np.array([0, 1]), np.zeros((1, 1, 2), np.float32), np.zeros((1, 1, 2), np.float32))
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_paged_attention("cuda")


def test_batch_attention_extra_seconds_times_b_calls_against_one(tiny):
    """Lessons 8 and 9's third step-time term: one sequence is the same call both ways (exactly 0), more sequences
    give a finite time, and a batch of no sequences or no context is refused in words."""
    from tinyserve.attention_backends import batch_attention_extra_seconds
    assert batch_attention_extra_seconds(tiny.config, 1, context=20) == 0.0
    extra = batch_attention_extra_seconds(tiny.config, 4, context=20, repeat=3)
    assert np.isfinite(extra) and abs(extra) < 1.0
    for bad in ({"n_seqs": 0, "context": 20}, {"n_seqs": 2, "context": 0}):
        with pytest.raises(ValueError, match="batch_attention_extra_seconds"):
            batch_attention_extra_seconds(tiny.config, **bad)
