"""Lesson 11 self-checks: which block a local layer still reads, releasing the rest, attention over the window, and
the bytes of a matrix in a block format (the LM head's share of a decode step).

`make check-11` runs these against lessons/11_second_model/exercises.py; `make test` runs them against tinyserve.
They need no model: block tables, an allocator, random K/V and small random matrices are enough.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.lessons.impl import CHECKS, load_impl
from tinyserve.paged import BlockAllocator

REFERENCE = {
    "first_live_block": "tinyserve.kv_sizing:first_live_block",
    "release_behind_window": "tinyserve.block_manager:release_behind_window",
    "window_attention": "tinyserve.paged:window_attention",
    "matrix_bytes": "tinyserve.roofline:matrix_bytes",
}
impl = load_impl(11, REFERENCE)


# --- which block a local layer still reads -------------------------------------------------------------------

@pytest.mark.exercise("first_live_block")
def test_first_live_block_small_cases():
    # window 8, blocks of 4: the row at 12 sees 5..12, which starts in block 1; the row at 11 sees 4..11 (block 1);
    # the row at 10 sees 3..10, still block 0
    assert impl.first_live_block(12, 8, 4) == 1
    assert impl.first_live_block(11, 8, 4) == 1, "the row at 11 sees keys 4..11: block 0 (keys 0..3) is dead"
    assert impl.first_live_block(10, 8, 4) == 0, "the row at 10 still sees key 3, in block 0"
    assert impl.first_live_block(3, 8, 4) == 0, "while the window reaches back past 0, nothing is dead"
    assert impl.first_live_block(1000, None, 16) == 0, "a global layer (window None) reads every block"


@pytest.mark.exercise("first_live_block")
@settings(CHECKS, max_examples=200)
@given(n=st.integers(0, 300), window=st.integers(1, 64), bs=st.integers(1, 16))
def test_first_live_block_is_the_block_of_the_oldest_visible_key(n, window, bs):
    got = impl.first_live_block(n, window, bs)
    oldest = max(0, n - window + 1)
    assert got == oldest // bs, (f"num_computed {n}, window {window}, bs {bs}: the next row sees keys {oldest}..{n}, "
                                 f"the oldest in block {oldest // bs}; got {got}")


# --- giving the dead blocks back -----------------------------------------------------------------------------

def a_sequence(n_blocks: int, bs: int, extra_owner: int | None = None):
    alloc = BlockAllocator(n_blocks + 3, bs)
    table = [alloc.allocate() for _ in range(n_blocks)]
    if extra_owner is not None:
        alloc.incref(table[extra_owner])      # the prefix cache, or another sequence, holds this one too
    return alloc, table


@pytest.mark.exercise("release_behind_window")
def test_release_frees_exactly_the_blocks_behind_the_window():
    alloc, table = a_sequence(6, 4)
    before = list(table)
    freed = impl.release_behind_window(table, 21, 8, 4, alloc)      # the row at 21 sees 14..21: blocks 3.. live
    assert freed == 3, f"blocks 0, 1, 2 hold keys 0..11, all behind key 14: 3 freed, got {freed}"
    assert table == [-1, -1, -1] + before[3:], f"freed entries become -1, the rest stay: got {table}"
    assert alloc.num_used == 3 and all(alloc.refcount[b] == 0 for b in before[:3])
    alloc.check()


@pytest.mark.exercise("release_behind_window")
def test_release_twice_frees_nothing_twice_and_keeps_shared_blocks_alive():
    alloc, table = a_sequence(6, 4, extra_owner=1)
    impl.release_behind_window(table, 17, 8, 4, alloc)              # keys 10..17: blocks 0 and 1 dead
    assert impl.release_behind_window(table, 17, 8, 4, alloc) == 0, "a second call must free nothing"
    shared = [b for b in range(alloc.num_blocks) if alloc.refcount[b] == 1 and b not in table]
    assert len(shared) == 1, "the block another owner holds loses one reference, not all: it lives on"
    assert impl.release_behind_window(table, 21, 8, 4, alloc) == 1, "later, block 2 falls behind the window too"
    alloc.check()


@pytest.mark.exercise("release_behind_window")
@settings(CHECKS, max_examples=100)
@given(steps=st.lists(st.integers(1, 9), min_size=1, max_size=30), window=st.integers(1, 20), bs=st.integers(1, 6))
def test_release_during_a_decode_keeps_what_the_window_reads(steps, window, bs):
    """Grow a sequence chunk by chunk, releasing after each: every key the next row sees is still in a live
    block, and no more than blocks_for(window - 1) + 1 blocks are ever held."""
    alloc = BlockAllocator(200, bs)
    table, n = [], 0
    for step in steps:
        n += step
        while len(table) * bs < n:
            table.append(alloc.allocate())
        impl.release_behind_window(table, n, window, bs, alloc)
        live = [i for i, b in enumerate(table) if b >= 0]
        oldest = max(0, n - window + 1)
        assert all(table[p // bs] >= 0 for p in range(oldest, n)), f"a key the row at {n} reads was freed"
        first = live[0] if live else len(table)        # the next row's block may not be allocated yet
        assert first == min(oldest // bs, len(table)), f"blocks before {oldest // bs} should be freed, live: {live}"
        assert alloc.num_used == len(live)
    alloc.check()


# --- attention over the window -------------------------------------------------------------------------------

def dense(q, k, v, window):   # [m, N, H], [S, K, H] x2 -> [m, N, H]: one row at a time, its keys sliced
    m, N, H = q.shape
    S, K, _ = k.shape
    out = np.empty_like(q)
    for i in range(m):
        pos = S - m + i
        lo = max(0, pos - window + 1)
        for n in range(N):
            s = k[lo:pos + 1, n // (N // K)] @ q[i, n] / np.sqrt(H)
            p = np.exp(s - s.max())
            out[i, n] = (p / p.sum()) @ v[lo:pos + 1, n // (N // K)]
    return out


@pytest.mark.exercise("window_attention")
@pytest.mark.parametrize("m, S, window", [(1, 20, 8), (6, 20, 8), (20, 20, 8), (5, 9, 8), (4, 4, 1), (3, 30, 30)])
def test_window_attention_matches_row_by_row(m, S, window):
    rng = np.random.default_rng(m * 100 + S)
    N, K, H = 4, 2, 8
    q = rng.standard_normal((m, N, H)).astype(np.float32)
    k = rng.standard_normal((S, K, H)).astype(np.float32)
    v = rng.standard_normal((S, K, H)).astype(np.float32)
    got = impl.window_attention(q, k, v, window)
    assert got.shape == (m, N, H)
    np.testing.assert_allclose(got, dense(q, k, v, window), rtol=1e-5, atol=1e-5,
                               err_msg=f"m={m} new rows over S={S} keys, window {window}")


@pytest.mark.exercise("window_attention")
def test_a_decode_row_ignores_keys_behind_the_window():
    """One row over 12 keys with window 4: changing keys 0..7 must change nothing; changing key 8 must."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 8)).astype(np.float32)
    k = rng.standard_normal((12, 1, 8)).astype(np.float32)
    v = rng.standard_normal((12, 1, 8)).astype(np.float32)
    base = impl.window_attention(q, k, v, 4)
    k2, v2 = k.copy(), v.copy()
    k2[:8] *= 5
    v2[:8] += 3
    np.testing.assert_allclose(impl.window_attention(q, k2, v2, 4), base, rtol=1e-6, atol=1e-6,
                               err_msg="the row at 11 sees keys 8..11 only: keys 0..7 must not matter")
    v2[8] += 3
    assert not np.allclose(impl.window_attention(q, k2, v2, 4), base), "key 8 is inside the window: it matters"


# --- the bytes of a matrix in a block format -----------------------------------------------------------------

GGUF_FORMATS = ("Q8_0", "Q5_0", "Q4_0", "Q4_1")


@pytest.mark.exercise("matrix_bytes")
def test_gemma_lm_head_in_its_file_and_on_the_byte_tiles():
    from tinyserve.roofline import BYTE_TILE, BYTE_TILE_NO_MIN, Q8_0
    V, D = 262144, 640
    assert impl.matrix_bytes(V, D, Q8_0) == V * D // 32 * 34, \
        "Q8_0: 32 weights a block as 32 bytes plus a 2-byte float16 scale, 34 bytes (8.5 bits a weight)"
    assert impl.matrix_bytes(V, D, BYTE_TILE_NO_MIN) == V * D // 32 * 34, \
        "the byte tile without a minimum: 32 bytes and a float16 scale per 32 weights, 34 bytes (Q8_0's own)"
    assert impl.matrix_bytes(V, D, BYTE_TILE) == V * D // 32 * 36, \
        "the byte tile: 32 bytes, a float16 scale and a float16 minimum per 32 weights, 36 bytes"


@pytest.mark.exercise("matrix_bytes")
@settings(CHECKS, max_examples=60)
@given(rows=st.integers(1, 300), blocks=st.integers(1, 40), name=st.sampled_from(GGUF_FORMATS))
def test_matrix_bytes_is_what_gguf_stores(rows, blocks, name):
    # gguf-py's table of llama.cpp's formats, (weights a block, bytes a block): an oracle that is not ours
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from tinyserve import roofline
    per_block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    got = impl.matrix_bytes(rows, blocks * per_block, getattr(roofline, name))
    assert got == rows * blocks * nbytes, (f"{rows} rows of {blocks} blocks of {name}: llama.cpp stores "
                                           f"{rows * blocks * nbytes} bytes ({nbytes} a block), got {got}")


@pytest.mark.exercise("matrix_bytes")
@settings(CHECKS, max_examples=20)
@given(d_in=st.sampled_from([32, 64, 96, 640]), outputs=st.integers(1, 48))
def test_matrix_bytes_is_what_the_fast_path_holds(d_in, outputs):
    # the engine's own matrices: a [D_in, O] weight has O rows of D_in inputs, its blocks along the inputs
    from tinyserve import quant
    from tinyserve.roofline import BYTE_TILE, BYTE_TILE_NO_MIN, NIBBLE_TILE
    w = np.random.default_rng(d_in * 100 + outputs).standard_normal((d_in, outputs)).astype(np.float32)
    s8 = quant.quantize_q8_blocks(w)                     # Q8_0's rule: m = -128 d, the tile without a minimum
    b8 = quant.B8Linear(s8.q, s8.d, s8.m, s8.mode)       # the same blocks on the byte tile that reads m
    for q, fmt in ((quant.quantize_q4_1(w), NIBBLE_TILE), (s8, BYTE_TILE_NO_MIN), (b8, BYTE_TILE)):
        want = quant.tile_nbytes(q, type(q))
        got = impl.matrix_bytes(outputs, d_in, fmt)
        assert got == want, f"a [{d_in}, {outputs}] weight on the {fmt.name}: the engine holds {want} bytes, got {got}"


@pytest.mark.exercise("matrix_bytes")
def test_matrix_bytes_wants_whole_blocks_along_a_row():
    from tinyserve.roofline import Q8_0
    assert impl.matrix_bytes(3, 64, Q8_0) == 3 * 2 * 34, "3 rows of 2 blocks: the rows need not be a multiple of 32"
    with pytest.raises(ValueError):
        impl.matrix_bytes(64, 40, Q8_0)          # a row of 40 weights is not whole blocks of 32
