"""Lesson 8 self-checks: the load prediction (Little's law fixed point), SSE framing, stop strings held back in a stream, the interleaved budget, the K/V
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
    "predict_load": "tinyserve.queueing:predict_load",
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
    for raw in ("raw\ntext", "raw\rtext", "raw\r\ntext"):
        with pytest.raises(ValueError):
            impl.sse_event(raw)        # SSE ends a line at CR, LF or CRLF: any of them would split the data line


def _sse_events(stream: str) -> list[str]:
    """The WHATWG event-stream parser, reduced to data: lines ending at CR, LF or CRLF; one optional space after
    the colon is dropped; a blank line dispatches the event (its data lines joined by LF); data without a closing
    blank line is never dispatched."""
    import re
    events, data = [], None
    for line in re.split(r"\r\n|\r|\n", stream):
        if line == "":
            if data is not None:
                events.append("\n".join(data))
            data = None
        elif line.startswith("data:"):
            value = line[5:]
            data = (data or []) + [value[1:] if value.startswith(" ") else value]
    return events


@pytest.mark.exercise("sse_event")
def test_sse_frames_make_a_stream_a_client_splits_into_events():
    chunks = [{"id": 1, "text": "Par"}, {"id": 2, "text": "is\r"}, {"id": 3, "text": ""}]
    stream = "".join(impl.sse_event(c) for c in chunks) + impl.sse_event("[DONE]")
    events = _sse_events(stream)
    assert events[-1] == "[DONE]", f"the stream must end with the event data: [DONE], got {events[-1:]}"
    assert [json.loads(e) for e in events[:-1]] == chunks, (
        f"a client that splits the stream at blank lines must get each chunk as one event, got {events}")
    assert all(impl.sse_event(c).startswith("data: ") for c in chunks), "the field is 'data: ' (with its space)"


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


@pytest.mark.exercise("export_kv")
@pytest.mark.parametrize("n_prompt,block_size", [(37, 8), (40, 16), (29, 4)])
def test_export_kv_follows_a_block_table_with_gaps(tiny, n_prompt, block_size):
    """A decoding tenant takes a new block while the prompt is prefilled in chunks of 8 tokens, so the prompt's
    blocks are not consecutive in the pool: only the block table says where its positions live."""
    prompt = [int(t) for t in np.random.default_rng(n_prompt).integers(3, 256, n_prompt)]
    engine = Engine(tiny, num_blocks=32, block_size=block_size, max_batch_tokens=8)
    engine.add_request(list(range(3, 2 + block_size)), SamplingParams(temperature=0, max_new_tokens=60,
                                                                      ignore_eos=True))
    rid = engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=8))
    while engine.sequence(rid).num_computed_tokens < n_prompt:
        engine.step()
    seq = engine.sequence(rid)
    table = list(seq.block_table)
    assert table != list(range(table[0], table[0] + len(table))), f"the test needs a table with gaps, got {table}"
    k, v = impl.export_kv(engine, seq, n_prompt)
    cache = KVCache.allocate(tiny.config, max_len=64)
    prefill(tiny, cache, prompt)
    np.testing.assert_allclose(k, cache.k[:, :n_prompt], rtol=1e-5, atol=1e-5,
                               err_msg=f"block table {table}: position p lives in block table[p // bs], not in "
                                       f"the p // bs-th block after the first")
    np.testing.assert_allclose(v, cache.v[:, :n_prompt], rtol=1e-5, atol=1e-5)


# --- predict_load --------------------------------------------------------------------------------------------

def _fixed_point_linear(rate, prompt, out, a, b, pp):
    """B = rate * W(B) solved by hand for t_step(B) = a + b * B: W = prompt * pp + (out + 0.5) * t_step(B)."""
    c0, c1 = prompt * pp, out + 0.5
    return rate * (c0 + c1 * a) / (1 - rate * c1 * b)


@pytest.mark.exercise("predict_load")
def test_predict_load_constant_step_is_littles_law_by_hand():
    # t_step = 20 ms at every batch: W = 1.5 * 20 ms + 50 * 0.5 ms + 11 * 20 ms = 275 ms, B = 2 * 0.275 = 0.55
    p = impl.predict_load(2.0, 50, 12, lambda B: 0.020, 0.0005)
    assert p.stable, "2 requests/s with 275 ms each is far below any limit: stable=True"
    assert p.batch == pytest.approx(0.55, rel=1e-4), (
        f"batch {p.batch}: Little's law gives B = rate * W = 2/s * (1.5 * 20 ms + 50 * 0.5 ms + 11 * 20 ms) = 0.55")
    assert p.step == pytest.approx(0.020) and p.itl == pytest.approx(0.020), "step and itl: t_step at that batch"
    assert p.ttft == pytest.approx(0.030 + 0.025, rel=1e-6), (
        f"ttft {p.ttft}: half a step of waiting + one step + the prompt's prefill (50 * 0.5 ms) = 55 ms")
    assert p.rate == 2.0 and p.latency == pytest.approx(0.275, rel=1e-4), "latency = batch / rate = W"


@pytest.mark.exercise("predict_load")
@settings(CHECKS, max_examples=60)
@given(st.floats(0.05, 20), st.integers(1, 300), st.integers(2, 64), st.floats(0.002, 0.08), st.floats(0, 0.02),
       st.floats(1e-5, 2e-3))
def test_predict_load_solves_the_fixed_point_when_step_grows_with_batch(rate, prompt, out, a, b, pp):
    step = lambda B: a + b * B                                           # noqa: E731  (a measured line, as in the notebook)
    rho = rate * (out + 0.5) * b                                         # how much W grows per request in the system
    exact = _fixed_point_linear(rate, prompt, out, a, b, pp) if rho < 1 else float("inf")
    p = impl.predict_load(rate, prompt, out, step, pp, max_batch=64)
    if exact <= 60 and rho < 0.8:                                        # (near rho = 1 any iteration settles slowly)
        assert p.stable, f"rate {rate}: the fixed point B = {exact:.3f} is below max_batch, so stable=True"
        assert p.batch == pytest.approx(exact, rel=1e-3, abs=1e-5), (
            f"batch {p.batch} at rate {rate}, t_step(B) = {a} + {b} * B: B must satisfy B = rate * W(B) with t_step "
            f"taken at that same B (solved by hand: {exact:.5f}); t_step(1) or the first guess is not the answer")
        assert p.step == pytest.approx(step(p.batch), rel=1e-9) and p.itl == pytest.approx(p.step, rel=1e-9), (
            "step and itl are t_step at the batch you return")
        assert p.ttft == pytest.approx(1.5 * p.step + prompt * pp, rel=1e-9), "ttft = 1.5 t_step(B) + prefill"
    elif rho >= 1 or exact > 70:
        assert not p.stable, (
            f"rate {rate}: each request adds {rho:.2f} requests' worth of time to everyone's stay (>= 1, or a fixed "
            f"point beyond max_batch): the queue grows without bound, so stable=False")
        assert p.batch == 64 and p.ttft == float("inf") and p.step == pytest.approx(step(64), rel=1e-9), (
            "saturated: batch = max_batch, ttft = inf, step = itl = t_step(max_batch)")


@pytest.mark.exercise("predict_load")
def test_predict_load_default_max_batch_is_64():
    # t_step = 20 ms flat, no prompt: W = (1.5 + 99) * 20 ms = 2.01 s, so B = 2.01 * rate lands either side of 64
    below = impl.predict_load(63.5 / 2.01, 0, 100, lambda B: 0.020, 0.0)
    above = impl.predict_load(64.5 / 2.01, 0, 100, lambda B: 0.020, 0.0)
    assert below.stable and below.batch == pytest.approx(63.5, rel=1e-4), (
        f"a fixed point of B = 63.5 is within the default max_batch = 64: stable, batch 63.5 (got {below})")
    assert not above.stable and above.batch == 64, (
        f"a fixed point of B = 64.5 exceeds the default max_batch = 64: stable=False, batch = 64 (got {above})")


@pytest.mark.exercise("predict_load")
def test_predict_load_saturates_and_respects_max_batch():
    step = lambda B: 0.010 + 0.002 * B                                    # noqa: E731
    # capacity of this line: rho = rate * 16.5 * 0.002 < 1 -> rate < 30.3/s, and the fixed point must stay <= max_batch
    ok = impl.predict_load(20.0, 32, 16, step, 0.001, max_batch=64)
    assert ok.stable and ok.batch == pytest.approx(_fixed_point_linear(20.0, 32, 16, 0.010, 0.002, 0.001), rel=1e-3)
    small = impl.predict_load(20.0, 32, 16, step, 0.001, max_batch=8)
    assert not small.stable and small.batch == 8, (
        f"with max_batch=8 the same 20/s needs a batch of {ok.batch:.1f}: more than the server holds, stable=False, "
        f"batch = max_batch (max_batch is an argument: use it, not 64)")
    assert small.step == pytest.approx(step(8)) and small.itl == pytest.approx(step(8)) and small.ttft == float("inf")
    for rate in (40.0, 1000.0):
        p = impl.predict_load(rate, 32, 16, step, 0.001)
        assert not p.stable and p.ttft == float("inf"), f"{rate}/s is beyond this server's capacity: stable=False"


@pytest.mark.exercise("predict_load")
def test_predict_load_grows_with_rate_and_keeps_the_inputs():
    step = lambda B: 0.015 + 0.001 * B                                    # noqa: E731
    batches = [impl.predict_load(r, 64, 12, step, 0.0008).batch for r in (0.1, 1.0, 5.0, 20.0)]
    assert batches == sorted(batches) and batches[0] < batches[-1], (
        f"batches {batches} at 0.1, 1, 5, 20 requests/s: more arrivals, more requests in the system")
    low = impl.predict_load(0.1, 64, 12, step, 0.0008)
    assert low.batch < 1 and low.batch == pytest.approx(_fixed_point_linear(0.1, 64, 12, 0.015, 0.001, 0.0008),
                                                        rel=1e-3), (
        f"at 0.1/s the system holds {low.batch:.4f} requests on average (less than one): do not clamp B to 1")
