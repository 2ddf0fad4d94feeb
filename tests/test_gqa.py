"""Lesson 3: grouped-query attention equals the repeat-based version, without the repeated copies."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve import kv_cache as kc
from tinyserve import naive
from tinyserve.gqa import grouped_attention
from tinyserve.sampling import SamplingParams


@settings(max_examples=60, deadline=None)
@given(K=st.integers(1, 4), g=st.integers(1, 4), H=st.sampled_from([2, 8, 16]), S=st.integers(1, 40),
       data=st.data())
def test_grouped_equals_repeat_based(K, g, H, S, data):
    m = data.draw(st.integers(1, S))                       # any rectangle: decode, chunk after history, prefill
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((m, K * g, H)).astype(np.float32)
    k, v = rng.standard_normal((2, S, K, H)).astype(np.float32)
    out = grouped_attention(q, k, v)
    assert out.shape == (m, K * g, H) and out.dtype == np.float32
    np.testing.assert_allclose(out, kc.rectangular_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_grouped_does_not_materialise_repeated_kv():
    # MQA-like decode over a long context: repeating K and V to N heads would allocate 2*S*N*H floats (16 MiB)
    S, N, K, H = 4096, 8, 1, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, N, H)).astype(np.float32)
    k, v = rng.standard_normal((2, S, K, H)).astype(np.float32)
    repeated_bytes = 2 * S * N * H * 4
    peaks = {}
    for fn in (grouped_attention, kc.rectangular_attention):
        tracemalloc.start()                                 # numpy reports its buffers to tracemalloc
        fn(q, k, v)
        peaks[fn.__name__] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["rectangular_attention"] > repeated_bytes  # the copies are really there...
    assert peaks["grouped_attention"] < repeated_bytes / 8  # ...and really gone


@pytest.mark.real
def test_smol_grouped_and_repeat_paths_give_naive_tokens(smol, smol_tok):
    ids = smol_tok.encode_chat([{"role": "user", "content": "Name two planets."}])
    greedy = SamplingParams(temperature=0)
    expected = naive.generate(smol, ids, 10, greedy)
    assert list(kc.generate_stream(smol, ids, 10, greedy, attend=grouped_attention)) == expected
    assert list(kc.generate_stream(smol, ids, 10, greedy, attend=kc.rectangular_attention)) == expected
