"""Lesson 3 self-checks: grouped-query attention and the bytes decode attention moves.

`make check-3` runs these against lessons/03_gqa/exercises.py; `make test` runs them against tinyserve.
"""
from __future__ import annotations

import tracemalloc
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.lessons.impl import CHECKS, load_impl
from tinyserve.config import ModelConfig
from tinyserve.kv_cache import rectangular_attention

REFERENCE = {
    "grouped_attention": "tinyserve.gqa:grouped_attention",
    "attention_decode_bytes": "tinyserve.roofline:attention_decode_bytes",
}
impl = load_impl(3, REFERENCE)

SMOL = ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152)


def qkv(m, S, N, K, H, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((m, N, H)).astype(np.float32)
    k, v = rng.standard_normal((2, S, K, H)).astype(np.float32)
    return q, k, v


# --- grouped_attention -----------------------------------------------------------------------------------------

@pytest.mark.exercise("grouped_attention")
@pytest.mark.parametrize("m,S", [(1, 1), (1, 30), (6, 6), (4, 19)])   # decode, prefill, chunk after history
def test_grouped_matches_repeat_based_smollm2_shapes(m, S):
    q, k, v = qkv(m, S, N=9, K=3, H=64, seed=m * 100 + S)
    out = impl.grouped_attention(q, k, v)
    assert out.shape == (m, 9, 64), f"q [m, N, H] -> [m, N, H] = {(m, 9, 64)}, got {out.shape}"
    np.testing.assert_allclose(out, rectangular_attention(q, k, v), rtol=1e-5, atol=1e-6,
        err_msg='grouped_attention differs from the repeat-based attention of lesson 2 (same numbers expected, no copy)')


@pytest.mark.exercise("grouped_attention")
@pytest.mark.parametrize("N,K", [(4, 4), (4, 1), (6, 2)])           # MHA, MQA, GQA
def test_grouped_matches_repeat_based_mha_mqa_gqa(N, K):
    q, k, v = qkv(3, 11, N, K, 8, seed=N * 10 + K)
    np.testing.assert_allclose(impl.grouped_attention(q, k, v), rectangular_attention(q, k, v),
                               rtol=1e-5, atol=1e-6,
        err_msg='grouped_attention differs from the repeat-based attention of lesson 2 (same numbers expected, no copy)')


@pytest.mark.exercise("grouped_attention")
@settings(CHECKS, max_examples=40)
@given(S=st.integers(1, 13), new=st.integers(1, 13), heads=st.sampled_from([(4, 4), (6, 2), (6, 3), (3, 1)]),
       H=st.sampled_from([4, 8]), seed=st.integers(0, 2**16))
def test_grouped_matches_repeat_based_for_every_chunk_length(S, new, heads, H, seed):
    """Every block length m from 1 (decode) to S (prefill), not just the lengths someone thought of: a mask that is
    skipped for small chunks, or applied from the wrong row, shows up at m = 2 or 3 after a history."""
    m, (N, K) = min(new, S), heads
    q, k, v = qkv(m, S, N, K, H, seed=seed)
    q *= np.float32(1 + seed % 7)                                      # sharper scores: the mask matters more
    np.testing.assert_allclose(impl.grouped_attention(q, k, v), rectangular_attention(q, k, v), rtol=1e-5, atol=1e-6,
        err_msg=f'm = {m} new rows over S = {S} keys ({N} query heads, {K} K/V heads): every chunk length must be '
                f'masked like lesson 2 (history visible to every row, new row i sees new keys 0..i)')


@pytest.mark.exercise("grouped_attention")
def test_query_head_groups_use_their_own_kv_head():
    # heads 0..g-1 belong to K/V head 0, heads g..2g-1 to head 1 (the layout of the Q/K/V projections)
    q, k, v = qkv(1, 5, N=4, K=2, H=8, seed=7)
    v[:, 1] = 0.0                                                      # K/V head 1 carries no signal...
    out = impl.grouped_attention(q, k, v)
    assert np.abs(out[:, 2:]).max() == 0, "query heads 2 and 3 must read K/V head 1"
    assert np.abs(out[:, :2]).min() > 0                                # ...head 0 does


@pytest.mark.exercise("grouped_attention")
def test_grouped_does_not_copy_kv_per_query_head():
    q, k, v = qkv(1, 4096, N=8, K=1, H=64)
    tracemalloc.start()
    impl.grouped_attention(q, k, v)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    repeated = 2 * 4096 * 8 * 64 * 4
    assert peak < repeated / 8, f"peak {peak / 2**20:.1f} MiB: K/V were repeated per query head ({repeated / 2**20:.0f} MiB)"


# --- attention_decode_bytes: the byte count behind the 7x ------------------------------------------------------
# Inputs where the plausible wrong formulas differ from the right one: g != K (SmolLM2 has g = K = 3, so "1 + 2K"
# and "1 + 2g" agree there), L, H and the context not round, both 2- and 4-byte values, K > 1 (one K/V head hides a
# forgotten factor K).

ODD = ModelConfig(dim=720, n_layers=5, n_heads=10, n_kv_heads=2, intermediate_size=96,
                  vocab_size=64)                                        # N = 10, K = 2: g = 5 != K; H = 72


def traffic(config, context, bytes_per_value, repeat_kv):
    """The bytes counted array by array, as the attention code touches them (a slow, literal count)."""
    L, N, K, H = config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim
    moved = 0
    for _layer in range(L):
        for _array in ("K", "V"):
            moved += context * K * H                                    # the cached [S, K, H] read
            if repeat_kv:
                moved += context * N * H                                # np.repeat writes [S, N, H]
                moved += context * N * H                                # the matmul reads the copy back
    return moved * bytes_per_value


@pytest.mark.exercise("attention_decode_bytes")
def test_attention_decode_bytes_smollm2_grouped_is_the_cache_once():
    got = impl.attention_decode_bytes(SMOL, 1000)
    assert got == 46_080_000, (f"grouped, SmolLM2 fp32, context 1000: 2 (K and V) * 30 layers * 3 kv heads * 64 "
                               f"* 4 bytes * 1000 positions = 46080000 (each cached value read once), got {got}")


@pytest.mark.exercise("attention_decode_bytes")
@pytest.mark.parametrize("context,b", [(37, 2), (37, 4), (1, 4), (250, 1)])
@pytest.mark.parametrize("repeat_kv", [False, True])
def test_attention_decode_bytes_counts_every_array(context, b, repeat_kv):
    want = traffic(ODD, context, b, repeat_kv)
    got = impl.attention_decode_bytes(ODD, context, bytes_per_value=b, repeat_kv=repeat_kv)
    assert got == want, (f"L = 5 layers, N = 10 query heads, K = 2 kv heads (g = 5), H = 72, context {context}, "
                         f"{b}-byte values, repeat_kv={repeat_kv}: expected {want} bytes, got {got}. Per layer: K and V "
                         f"[S, K, H] read once" + ("; np.repeat writes [S, N, H] copies of both and the matmuls read "
                                                   "them back" if repeat_kv else ""))


@pytest.mark.exercise("attention_decode_bytes")
@pytest.mark.parametrize("N,K", [(9, 3), (10, 2), (12, 4), (8, 1)])
def test_repeat_moves_one_plus_two_g_times_the_bytes(N, K):
    c = replace(ODD, n_heads=N, n_kv_heads=K)
    g = N // K
    grouped = impl.attention_decode_bytes(c, 301)
    repeat = impl.attention_decode_bytes(c, 301, repeat_kv=True)
    assert grouped > 0 and repeat == (1 + 2 * g) * grouped, (
        f"N = {N}, K = {K} (g = {g}): repeat-based / grouped = {repeat}/{grouped} = {repeat / max(grouped, 1):.2f}, "
        f"expected 1 + 2g = {1 + 2 * g} (read the cache, write g copies, read them back)")


@pytest.mark.exercise("attention_decode_bytes")
def test_attention_decode_bytes_grows_with_the_context_and_the_layers():
    one = impl.attention_decode_bytes(ODD, 1, bytes_per_value=2)
    assert impl.attention_decode_bytes(ODD, 513, bytes_per_value=2) == 513 * one, "bytes are linear in the context"
    deeper = impl.attention_decode_bytes(replace(ODD, n_layers=7), 513, bytes_per_value=2)
    assert deeper == 7 * 513 * one // 5, "every layer has its own cache: bytes are linear in the layers"
