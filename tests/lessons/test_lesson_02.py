"""Lesson 2 self-checks: the cache append/read, the rectangular mask, the cached forward step, the generate loop.

`make check-2` runs these against lessons/02_kv_cache/exercises.py; `make test` runs them against tinyserve.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import tinyserve as ts
from tests.lessons.impl import load_impl
from tinyserve import naive
from tinyserve.kv_cache import KVCache, KVCacheFull, rectangular_attention
from tinyserve.layers import causal_attention, softmax
from tinyserve.sampling import SamplingParams

REFERENCE = {
    "append_kv": "tinyserve.kv_cache:append_kv",
    "rectangular_mask": "tinyserve.kv_cache:rectangular_mask",
    "forward_with_cache": "tinyserve.kv_cache:forward_with_cache",
    "generate": "tinyserve.kv_cache:generate",
}
impl = load_impl(2, REFERENCE)
GREEDY = SamplingParams(temperature=0)


def random_kv(rng, m, K=2, H=16):
    return rng.standard_normal((2, m, K, H)).astype(np.float32)


# --- append_kv ------------------------------------------------------------------------------------------------

@pytest.mark.exercise("append_kv")
def test_append_kv_first_block(tiny):
    cache = KVCache.allocate(tiny.config, 16)
    k, v = random_kv(np.random.default_rng(0), 5)
    k_all, v_all = impl.append_kv(cache, 0, k, v)
    np.testing.assert_array_equal(k_all, k,
        err_msg="append_kv should return the new block's keys when the cache was empty")
    np.testing.assert_array_equal(v_all, v,
        err_msg="append_kv should return the new block's values when the cache was empty")
    np.testing.assert_array_equal(cache.k[0, :5], k,
        err_msg='the keys must be stored in cache.k[layer, 0:m]')         # it is stored in the cache...
    np.testing.assert_array_equal(cache.v[0, :5], v, err_msg='the values must be stored in cache.v[layer, 0:m]')
    assert not cache.k[1].any()                               # ...of that layer only
    assert cache.length == 0, "append_kv must not advance cache.length: the caller does, after the last layer"


@pytest.mark.exercise("append_kv")
def test_append_kv_after_history_returns_history_plus_block(tiny):
    cache = KVCache.allocate(tiny.config, 16)
    rng = np.random.default_rng(1)
    k1, v1 = random_kv(rng, 4)
    cache.k[1, :4], cache.v[1, :4], cache.length = k1, v1, 4  # 4 positions already cached
    k2, v2 = random_kv(rng, 1)
    k_all, v_all = impl.append_kv(cache, 1, k2, v2)
    assert k_all.shape == (5, 2, 16), "history (4) + new block (1) positions"
    np.testing.assert_array_equal(k_all, np.concatenate([k1, k2]),
        err_msg='append_kv should return history (4 cached) + the new block, in order: write at position cache.length')
    np.testing.assert_array_equal(v_all, np.concatenate([v1, v2]),
        err_msg='append_kv should return history + new block of values')
    assert np.shares_memory(k_all, cache.k), "return views of the cache (slices), not copies"


@pytest.mark.exercise("append_kv")
def test_append_kv_refuses_to_overflow(tiny):
    cache = KVCache.allocate(tiny.config, 6)
    cache.length = 4
    k, v = random_kv(np.random.default_rng(2), 3)
    with pytest.raises(KVCacheFull):
        impl.append_kv(cache, 0, k, v)
    assert not cache.k.any(), "nothing may be written when the block does not fit"
    impl.append_kv(cache, 0, k[:2], v[:2])                    # exactly full is fine


# --- rectangular_mask ------------------------------------------------------------------------------------------

@pytest.mark.exercise("rectangular_mask")
def test_mask_prefill_is_the_causal_triangle():
    mask = impl.rectangular_mask(4, 4)
    assert mask.shape == (4, 4) and mask.dtype == bool
    np.testing.assert_array_equal(mask, np.triu(np.ones((4, 4), bool), k=1),
        err_msg='prefill (m == S) is the causal triangle: True above the diagonal')


@pytest.mark.exercise("rectangular_mask")
def test_mask_decode_and_chunk_after_history():
    assert not impl.rectangular_mask(1, 9).any(), "decode: the one new token sees the whole history and itself"
    mask = impl.rectangular_mask(3, 7)                        # 4 history keys + 3 new
    expected = np.array([[0, 0, 0, 0, 0, 1, 1],
                         [0, 0, 0, 0, 0, 0, 1],
                         [0, 0, 0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(mask, expected,
        err_msg='3 new rows after 4 history keys: row i sees every history key and new keys 0..i')


@pytest.mark.exercise("rectangular_mask")
def test_mask_gives_the_tail_of_full_causal_attention():
    rng = np.random.default_rng(3)
    S, m, N, H = 12, 5, 4, 8
    q = rng.standard_normal((S, N, H)).astype(np.float32)
    k, v = rng.standard_normal((2, S, N, H)).astype(np.float32)
    scores = q[S - m:].transpose(1, 0, 2) @ k.transpose(1, 2, 0) / np.sqrt(H)   # [N, m, S]
    scores[:, impl.rectangular_mask(m, S)] = -np.inf
    out = (softmax(scores) @ v.transpose(1, 0, 2)).transpose(1, 0, 2)
    np.testing.assert_allclose(out, causal_attention(q, k, v)[S - m:], rtol=1e-5, atol=1e-6,
        err_msg="masked attention over the last m rows must equal full causal attention's last m rows")


# --- forward_with_cache: one step over the cache ----------------------------------------------------------------

@pytest.mark.exercise("forward_with_cache")
def test_forward_with_cache_prefill_then_decode_matches_the_full_forward(tiny):
    ids = np.random.default_rng(5).integers(3, 256, 12)
    full = naive.forward(tiny, ids)                                       # [12, V]: every position, no cache
    cache = KVCache.allocate(tiny.config, 16)
    logits = impl.forward_with_cache(tiny, cache, ids[:7])
    assert logits.shape == (1, tiny.config.vocab_size), f"prefill returns the last row only: [1, V], got {logits.shape}"
    np.testing.assert_allclose(logits[0], full[6], rtol=1e-4, atol=1e-4,
                               err_msg="prefill of 7 tokens: the logits must be those of the LAST prompt token")
    assert cache.length == 7, f"after prefilling 7 tokens cache.length must be 7, got {cache.length}"
    for t in range(7, 12):                                                # decode: one token at a time
        logits = impl.forward_with_cache(tiny, cache, ids[t:t + 1])
        np.testing.assert_allclose(
            logits[0], full[t], rtol=1e-4, atol=1e-4,
            err_msg=f"decode of token {t}: its position is {t} (the cache length), not 0; it must see every cached key")
        assert cache.length == t + 1, f"each decode step adds 1 to cache.length: want {t + 1}, got {cache.length}"


@pytest.mark.exercise("forward_with_cache")
def test_forward_with_cache_chunk_after_history_all_logits(tiny):
    ids = np.random.default_rng(6).integers(3, 256, 10)
    full = naive.forward(tiny, ids)
    cache = KVCache.allocate(tiny.config, 10)
    impl.forward_with_cache(tiny, cache, ids[:4])
    logits = impl.forward_with_cache(tiny, cache, ids[4:], all_logits=True)    # a chunk of 6 after 4 cached
    assert logits.shape == (6, tiny.config.vocab_size), f"all_logits=True returns [m, V], got {logits.shape}"
    np.testing.assert_allclose(logits, full[4:], rtol=1e-4, atol=1e-4,
                               err_msg="a chunk of 6 after 4 cached positions: rows must equal the full forward's 4..9")
    assert cache.length == 10


@pytest.mark.exercise("forward_with_cache")
def test_forward_with_cache_attends_with_the_attend_it_is_given(tiny):
    # the optional `attend` replaces the default attention: every layer of every step calls it, over history + new
    calls = []

    def attend(q, k_all, v_all):
        calls.append((q.shape[0], k_all.shape[0], v_all.shape[0]))
        return rectangular_attention(q, k_all, v_all)

    ids = np.random.default_rng(7).integers(3, 256, 9)
    full = naive.forward(tiny, ids)
    cache = KVCache.allocate(tiny.config, 9)
    impl.forward_with_cache(tiny, cache, ids[:5], attend=attend)
    logits = impl.forward_with_cache(tiny, cache, ids[5:], attend=attend, all_logits=True)
    L = tiny.config.n_layers
    assert calls == [(5, 5, 5)] * L + [(4, 9, 9)] * L, (
        f"attend was called as (new rows, keys, values) = {calls}: with attend given, each of the {L} layers must call "
        f"it once per step, with the m new queries and the keys/values of history + new ({[(5, 5, 5)] * L} for the "
        f"5-token prefill, then {[(4, 9, 9)] * L} for 4 more)")
    np.testing.assert_allclose(logits, full[5:], rtol=1e-4, atol=1e-4,
                               err_msg="with a given attend the logits must still be those of the full forward")


@pytest.mark.exercise("forward_with_cache")
def test_forward_with_cache_refuses_to_overflow_before_writing(tiny):
    cache = KVCache.allocate(tiny.config, 5)
    impl.forward_with_cache(tiny, cache, [5, 6, 7])
    k_before = cache.k.copy()
    with pytest.raises(KVCacheFull):
        impl.forward_with_cache(tiny, cache, [8, 9, 10])                   # 3 + 3 > 5
    assert cache.length == 3, "a refused step must leave cache.length alone"
    np.testing.assert_array_equal(cache.k, k_before, err_msg="a refused step must not write anything")


# --- generate: the prefill/decode loop -------------------------------------------------------------------------

@pytest.mark.exercise("generate")
def test_generate_matches_naive_greedy(tiny):
    rng = np.random.default_rng(4)
    for n in (1, 9, 60):        # several calls: nothing may carry over from one request to the next
        ids = rng.integers(3, 256, n).tolist()
        got, want = impl.generate(tiny, ids, 40, GREEDY), naive.generate(tiny, ids, 40, GREEDY)
        assert got == want, f"greedy, {n}-token prompt: yours {got[:8]}..., naive {want[:8]}..."


@pytest.mark.exercise("generate")
def test_generate_samples_like_naive_with_the_same_seed(tiny):
    # one rng per request, drawn from once per token: a fresh rng per step (or a reseed) repeats the same draw
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_new_tokens=30, ignore_eos=True)
    ids = [5, 17, 99, 3]
    want = naive.generate(tiny, ids, params=params)
    got = impl.generate(tiny, ids, params=params)
    assert got == want, (f"sampled with seed 7 you produced {got[:8]}..., naive.generate {want[:8]}...: use the rng "
                         f"start_request gives you, once per sampled token, for the whole request")


@pytest.mark.exercise("generate")
def test_generate_repetition_penalty_sees_the_prompt(tiny):
    # the penalty applies to every token seen so far: the prompt's and the generated ones
    params = SamplingParams(temperature=0, repetition_penalty=1.5, max_new_tokens=20)
    ids = [5, 17, 99] + naive.generate(tiny, [5, 17, 99], 6, GREEDY)      # its greedy continuation repeats the prompt
    want = naive.generate(tiny, ids, params=params)
    assert impl.generate(tiny, ids, params=params) == want, \
        "with repetition_penalty, pass sample(..., seen=prompt + output so far), as naive.generate does"


@pytest.mark.exercise("generate")
def test_generate_near_the_context_window():
    # the cache holds at most max_seq_len positions; the request stops when the context is full
    small = ts.tiny_model(seed=0, max_seq_len=64)
    ids = np.random.default_rng(8).integers(3, 256, 58).tolist()
    want = naive.generate(small, ids, 40, GREEDY)
    assert len(want) < 40, "the context window must be what stops this request"
    assert impl.generate(small, ids, 40, GREEDY) == want, "size the cache with max_kv_positions (capped by the window)"


@pytest.mark.exercise("generate")
def test_generate_stops_like_naive(tiny):
    ids = [5, 17, 99]
    eos = naive.generate(tiny, ids, 10, GREEDY)[4]
    model = replace(tiny, config=replace(tiny.config, eos_token_ids=(eos,)))
    out = impl.generate(model, ids, 10, GREEDY)
    assert out == naive.generate(model, ids, 10, GREEDY) and out[-1] == eos, \
        f"got {out}: stop right after EOS (id {eos}) and include it, as naive.generate does"


class RowCounter(np.ndarray):
    """A weight array that counts the token rows multiplied by it: how many tokens went through the model."""
    rows = 0

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = [np.asarray(x) for x in inputs]
        RowCounter.rows += sum(x.shape[0] for x in inputs if x.ndim == 2)
        return getattr(ufunc, method)(*inputs, **kwargs)


@pytest.mark.exercise("generate")
def test_generate_runs_each_token_through_the_model_once(tiny):
    # layer 0's attention norm weight multiplies every token row of every forward exactly once
    first = replace(tiny.layers[0], attn_norm=tiny.layers[0].attn_norm.view(RowCounter))
    model = replace(tiny, layers=[first, *tiny.layers[1:]])
    RowCounter.rows = 0
    out = impl.generate(model, list(range(10, 30)), 15, GREEDY)
    assert len(out) == 15
    assert RowCounter.rows == 20 + 15 - 1, (
        f"{RowCounter.rows} token rows went through the model; with a KV cache it is the 20 prompt tokens once "
        f"(prefill) plus one per decode step (14): the last sampled token never needs a forward")
