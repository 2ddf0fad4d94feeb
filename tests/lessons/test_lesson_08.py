"""Lesson 8 self-checks: SSE framing, stop strings held back in a stream, the interleaved budget, the K/V
hand-over read side.

`make check-8` runs these against lessons/08_serving/exercises.py; `make test` runs them against tinyserve.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.lessons.impl import CHECKS, load_impl
from tinyserve.engine import Engine
from tinyserve.kv_cache import KVCache, prefill
from tinyserve.protocol import parse_sse
from tinyserve.sampling import SamplingParams

REFERENCE = {
    "sse_event": "tinyserve.protocol:sse_event",
    "held_back": "tinyserve.protocol:held_back",
    "interleave_budget": "tinyserve.queueing:interleave_budget",
    "export_kv": "tinyserve.orchestrators:export_kv",
}
impl = load_impl(8, REFERENCE)


# --- sse_event -----------------------------------------------------------------------------------------------

@pytest.mark.exercise("sse_event")
def test_sse_frames_compact_json_and_done():
    assert impl.sse_event({"a": 1, "b": [1, 2]}) == 'data: {"a":1,"b":[1,2]}\n\n'
    assert impl.sse_event("[DONE]") == "data: [DONE]\n\n"


@pytest.mark.exercise("sse_event")
def test_sse_escapes_what_would_break_a_line():
    frame = impl.sse_event({"text": "two\nlines \u2028 caf\u00e9 \x85"})
    body = frame[len("data: "):-2]
    assert frame.startswith("data: ") and frame.endswith("\n\n") and "\n" not in body
    assert body.isascii(), "non-ASCII must be escaped: clients that split with str.splitlines break at U+2028"
    assert list(parse_sse(frame.splitlines())) == [{"text": "two\nlines \u2028 caf\u00e9 \x85"}]
    with pytest.raises(ValueError):
        impl.sse_event("raw\ntext")


@pytest.mark.exercise("sse_event")
@settings(CHECKS)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                    max_leaves=8))
def test_sse_round_trips_any_json(value):
    frame = impl.sse_event({"v": value})
    assert frame.count("\n") == 2 and frame.endswith("\n\n")
    assert json.loads(frame[len("data: "):]) == {"v": value}


# --- held_back -----------------------------------------------------------------------------------------------

@pytest.mark.exercise("held_back")
def test_held_back_examples():
    assert impl.held_back("the EN", ("END",)) == 2
    assert impl.held_back("the E", ("END",)) == 1
    assert impl.held_back("the END", ("END",)) == 0, "a complete stop string is found, not held back"
    assert impl.held_back("the", ("END",)) == 0
    assert impl.held_back("ab", ("abc", "b")) == 2, "the longest tail that could still become any stop string"
    assert impl.held_back("x\n", ("\n\n", "###")) == 1
    assert impl.held_back("anything", ()) == 0
    assert impl.held_back("", ("END",)) == 0
    assert impl.held_back("aa", ("aaa",)) == 2, "the tail matches the stop string at lengths 2 and 1: the longest counts"
    assert impl.held_back("caf\u00e9 \u00e9t", ("\u00e9t\u00e9", "\u00e9t\u00e9s")) == 2, \
        "non-ASCII: counted in characters (str), not in UTF-8 bytes"


@pytest.mark.exercise("held_back")
@settings(CHECKS)
@given(st.text("ab\n", max_size=12), st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_held_back_is_the_longest_proper_prefix_tail(text, stops):
    k = impl.held_back(text, tuple(stops))
    proper = {s[:j] for s in stops for j in range(1, len(s))}
    best = max((j for j in range(1, len(text) + 1) if text[len(text) - j:] in proper), default=0)
    assert k == best


# --- interleave_budget ---------------------------------------------------------------------------------------

@pytest.mark.exercise("interleave_budget")
def test_interleave_budget_examples():
    assert impl.interleave_budget(3, [100, 50], 64) == (3, [61, 0])
    assert impl.interleave_budget(0, [10, 20, 40], 64) == (0, [10, 20, 34])
    assert impl.interleave_budget(80, [5], 64) == (64, [0]), "more decodes than budget: prompts wait"
    assert impl.interleave_budget(2, [], 8) == (2, [])


@pytest.mark.exercise("interleave_budget")
@settings(CHECKS)
@given(st.integers(0, 50), st.lists(st.integers(1, 300), max_size=6), st.integers(1, 256))
def test_interleave_budget_invariants(decoding, remaining, budget):
    d, chunks = impl.interleave_budget(decoding, remaining, budget)
    assert d == min(decoding, budget) and len(chunks) == len(remaining)
    assert d + sum(chunks) == min(budget, decoding + sum(remaining)), "the budget is used as far as work allows"
    assert all(0 <= c <= r for c, r in zip(chunks, remaining))
    for i, c in enumerate(chunks):     # first come, first served: nobody gets tokens while someone before waits
        if c:
            assert all(chunks[j] == remaining[j] for j in range(i))


# --- export_kv -----------------------------------------------------------------------------------------------

@pytest.mark.exercise("export_kv")
@pytest.mark.parametrize("n_prompt,block_size", [(37, 8), (32, 16), (5, 16)])
def test_export_kv_equals_a_contiguous_cache(tiny, n_prompt, block_size):
    """The gathered K/V of a prompt are exactly what lesson 2's contiguous cache holds for it."""
    prompt = [int(t) for t in np.random.default_rng(n_prompt).integers(3, 256, n_prompt)]
    engine = Engine(tiny, num_blocks=32, block_size=block_size)
    engine.add_request([1, 2, 3, 4, 5, 6, 7], SamplingParams(temperature=0, max_new_tokens=4))  # another tenant
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=8))
    engine.step()
    engine.step()
    seq = engine.sequence(rid)
    assert seq.num_computed_tokens >= n_prompt
    k, v = impl.export_kv(engine, seq, n_prompt)
    cache = KVCache.allocate(tiny.config, max_len=64)
    prefill(tiny, cache, prompt)
    assert k.shape == v.shape == (tiny.config.n_layers, n_prompt, tiny.config.n_kv_heads, tiny.config.head_dim)
    np.testing.assert_allclose(k, cache.k[:, :n_prompt], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v, cache.v[:, :n_prompt], rtol=1e-5, atol=1e-5)
    k3, _ = impl.export_kv(engine, seq, 3)
    np.testing.assert_array_equal(k3, k[:, :3])
