"""Lesson 3 self-checks: grouped-query attention and the KV-size formulas.

`make check-3` runs these against lessons/03_gqa/exercises.py; `make test` runs them against tinyserve.
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.lessons.impl import CHECKS, load_impl
from tinyserve.config import ModelConfig
from tinyserve.kv_cache import rectangular_attention

REFERENCE = {
    "grouped_attention": "tinyserve.gqa:grouped_attention",
    "kv_bytes_per_token": "tinyserve.roofline:kv_bytes_per_token",
    "kv_cache_bytes": "tinyserve.roofline:kv_cache_bytes",
}
impl = load_impl(3, REFERENCE)

SMOL = ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152)
LLAMA2_13B = ModelConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, intermediate_size=13824,
                         vocab_size=32000)


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


# --- KV-size formulas ------------------------------------------------------------------------------------------

@pytest.mark.exercise("kv_bytes_per_token")
def test_kv_bytes_per_token_smollm2():
    got = impl.kv_bytes_per_token(SMOL)
    assert got == 46_080, f"SmolLM2: 2 (K and V) * 30 layers * 3 kv heads * 64 * 4 bytes = 46080, got {got}"
    assert impl.kv_bytes_per_token(SMOL, bytes_per_value=2) == 23_040


@pytest.mark.exercise("kv_bytes_per_token")
def test_kv_bytes_per_token_mha_vs_gqa():
    assert impl.kv_bytes_per_token(LLAMA2_13B, 2) == 819_200            # MHA, fp16: 800 KiB per token
    from dataclasses import replace
    assert impl.kv_bytes_per_token(replace(LLAMA2_13B, n_kv_heads=8), 2) == 163_840   # 1:5 GQA


@pytest.mark.exercise("kv_cache_bytes")
def test_kv_cache_bytes():
    got = impl.kv_cache_bytes(SMOL, 2048)
    assert got == 94_371_840, f"one 2048-token sequence: 2048 * 46080 = 94371840 bytes (90 MiB), got {got}"
    assert impl.kv_cache_bytes(SMOL, 1000, n_seqs=8, bytes_per_value=2) == 8 * 1000 * 23_040
    assert impl.kv_cache_bytes(LLAMA2_13B, 4096, bytes_per_value=2) == 3_355_443_200
