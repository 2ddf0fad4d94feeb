"""Lesson 11: sliding-window layers in the paged engine, on the tiny random model given a window.

The truth is a dense reference written here, independent of the engine: the whole sequence recomputed for every
token, each local layer's row i attending to keys i - W < j <= i. The paged engine must give its greedy tokens and
(within float tolerance) its logits however it is loaded (chunked prefill, preemption, a batch, speculative
decoding); freeing the local blocks behind the window must change nothing at all (bit for bit) against an engine
that keeps them; the local blocks a sequence holds must stay at the window's size however long it runs.
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyserve import engine as engine_mod
from tinyserve.attention_backends import check_block_tables
from tinyserve.engine import Engine
from tinyserve.kv_sizing import blocks_for, first_live_block, local_blocks_bound, paged_kv_bytes
from tinyserve.model import forward
from tinyserve.paged import paged_attention
from tinyserve.sampling import SamplingParams
from tinyserve.weights import tiny_model

from .handover import prefill_and_export

W = 8                  # the window: a few blocks of 4, so that blocks fall behind it within a short prompt


@pytest.fixture(scope="module")
def swa():
    """3 layers, every third global: layers 0 and 1 see the last 8 keys, layer 2 everything."""
    return tiny_model(n_layers=3, sliding_window=W, sliding_window_pattern=3)


@pytest.fixture(scope="module")
def all_local():
    """No global layer at all (a Mistral-style window on every layer): the global pool holds no layer."""
    return tiny_model(seed=1, n_layers=2, sliding_window=W)


def dense_window_attention(q, k, v, window):   # [S, N, H], [S, K, H] x2 -> [S, N, H]
    """Row i sees keys j with i - window < j <= i (window None: j <= i). One row at a time, no mask tricks."""
    S, N, H = q.shape
    g = N // k.shape[1]
    out = np.empty_like(q)
    for i in range(S):
        lo = 0 if window is None else max(0, i - window + 1)
        kk, vv = np.repeat(k[lo:i + 1], g, axis=1), np.repeat(v[lo:i + 1], g, axis=1)   # [n, N, H]
        s = np.einsum("nh,knh->nk", q[i], kk) / np.sqrt(H)                             # [N, n]
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[i] = np.einsum("nk,knh->nh", p / p.sum(axis=1, keepdims=True), vv)
    return out


def reference(model, prompt, n_new):
    """Greedy tokens and the logits [n_new, V] they were picked from, the whole sequence recomputed each time."""
    cfg, ids, logits = model.config, list(prompt), []
    for _ in range(n_new):
        attention = lambda i, q, k, v: dense_window_attention(q, k, v, cfg.layer_window(i))  # noqa: E731
        row = forward(model, np.array(ids), np.arange(len(ids)), attention, logit_rows=np.array([len(ids) - 1]))[0]
        logits.append(row)
        ids.append(int(np.argmax(row)))
    return ids[len(prompt):], np.array(logits)


def prompts(n=6, seed=0, lo=1, hi=40):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 256, size=int(m))] for m in rng.integers(lo, hi, size=n)]


def run(engine, ps, params, monkeypatch):
    """engine.generate, also catching every sampled row's logits: {request index: [n_new, V]}."""
    seen: dict[int, list] = {}
    real = engine_mod.sample_tokens

    def spy(seq, logits, *a, **kw):
        seen.setdefault(seq.request_id, []).append(np.array(logits))
        return real(seq, logits, *a, **kw)
    monkeypatch.setattr(engine_mod, "sample_tokens", spy)
    first = engine._next_id
    out = engine.generate(ps, params)
    return out, [np.array(seen[first + i]) for i in range(len(ps))]


def assert_no_leaks(engine):
    for alloc in (engine.blocks.allocator, engine.blocks.local):
        alloc.check()
        assert alloc.num_free == alloc.num_blocks, f"{alloc.num_used} blocks leaked"


GREEDY = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
# (num_blocks, block_size, max_batch_tokens): roomy; chunked prefill; a pool small enough to preempt
CONFIGS = {"roomy": (128, 4, 256), "chunked-5": (128, 4, 5), "tiny-pool-preempts": (24, 4, 32),
           "block-size-1": (200, 1, 17)}


@pytest.mark.parametrize("num_blocks, bs, budget", CONFIGS.values(), ids=CONFIGS.keys())
def test_engine_matches_the_dense_reference(swa, monkeypatch, num_blocks, bs, budget):
    ps = prompts()
    engine = Engine(swa, num_blocks=num_blocks, block_size=bs, max_batch_tokens=budget)
    tokens, logits = run(engine, ps, GREEDY, monkeypatch)
    for p, got_t, got_l in zip(ps, tokens, logits):
        want_t, want_l = reference(swa, p, GREEDY.max_new_tokens)
        assert got_t == want_t
        np.testing.assert_allclose(got_l, want_l, rtol=1e-4, atol=1e-4)
    assert_no_leaks(engine)
    if num_blocks == 24:
        assert sum(s.num_preempted for s in engine.stats) > 0, "this pool is meant to force preemption"


def test_a_model_with_only_local_layers(all_local, monkeypatch):
    ps = prompts(n=3, seed=2, lo=10, hi=30)
    engine = Engine(all_local, num_blocks=64, block_size=4, max_batch_tokens=7)
    assert engine.pool.k.shape[0] == 0 and engine.local_pool.k.shape[0] == 2
    tokens, logits = run(engine, ps, GREEDY, monkeypatch)
    for p, got_t, got_l in zip(ps, tokens, logits):
        want_t, want_l = reference(all_local, p, GREEDY.max_new_tokens)
        assert got_t == want_t
        np.testing.assert_allclose(got_l, want_l, rtol=1e-4, atol=1e-4)
    assert_no_leaks(engine)


@pytest.mark.parametrize("budget", [256, 6])
def test_freeing_behind_the_window_changes_no_bit(swa, monkeypatch, budget):
    ps = prompts(n=4, seed=3, lo=20, hi=60)
    params = SamplingParams(temperature=0, max_new_tokens=30, ignore_eos=True)
    results = []
    for free in (True, False):
        engine = Engine(swa, num_blocks=128, block_size=4, max_batch_tokens=budget)
        engine.blocks.free_behind_window = free
        results.append(run(engine, ps, params, monkeypatch))
        assert_no_leaks(engine)
        peak = engine.blocks.local_peak
        if free:
            freed_peak = peak
    (t_free, l_free), (t_keep, l_keep) = results
    assert t_free == t_keep
    assert all(np.array_equal(a, b) for a, b in zip(l_free, l_keep))
    assert freed_peak < peak, "keeping every block must hold more local blocks than freeing them"


def test_local_blocks_stay_at_window_size_in_a_long_decode(swa):
    bs, n_prompt, n_new = 4, 37, 200
    engine = Engine(swa, num_blocks=128, block_size=bs, max_batch_tokens=16)
    rid = engine.add_request(list(range(3, 3 + n_prompt)), SamplingParams(temperature=0, max_new_tokens=n_new,
                                                                          ignore_eos=True))
    most = blocks_for(W - 1, bs) + 1         # between steps: the last W - 1 keys and the block being filled
    local_used, global_used = [], []
    while engine.has_unfinished():
        engine.step()
        if engine.running:
            seq = engine.running[0]
            local_used.append(engine.blocks.local.num_used)
            global_used.append(engine.blocks.allocator.num_used)
            live = [b for b in seq.local_table if b >= 0]
            assert len(live) == engine.blocks.local.num_used <= most
            first = first_live_block(seq.num_computed_tokens, W, bs)
            assert all(b < 0 for b in seq.local_table[:first]) and all(b >= 0 for b in seq.local_table[first:])
    print(f"\nglobal blocks in use grew to {max(global_used)}, local ones stayed at <= {max(local_used)} "
          f"(window {W} = {W // bs} blocks of {bs}; {n_prompt} + {n_new} positions)")
    assert max(global_used) == blocks_for(n_prompt + n_new - 1, bs)
    assert max(local_used) == most
    assert engine.blocks.local_peak <= most + blocks_for(16, bs) + 1      # a prefill chunk adds its own blocks
    assert len(engine.finished[rid].output_ids) == n_new
    assert_no_leaks(engine)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("budget", [64, 5])
def test_prefix_caching_on_and_off_give_the_same_answers(swa, monkeypatch, backend, budget):
    """Prefix hits with local layers (BlockManager.usable_hit, LocalTwins): the same tokens as without a cache, the
    logits within float32 noise (a hit changes a prefill chunk's row count, and BLAS sums by it: the quantised
    fast path's test is bit for bit, tests/test_block_forward.py), and the second round does hit."""
    system = list(range(40, 70))                                    # a shared prefix of 30 tokens: 7 full blocks
    ps = [system + p for p in prompts(n=4, seed=4, lo=3, hi=12)]
    outs = []
    for caching in (False, True):
        engine = Engine(swa, num_blocks=96, block_size=4, max_batch_tokens=budget, prefix_caching=caching,
                        backend=backend)
        outs.append(run(engine, ps, GREEDY, monkeypatch))
        outs.append(run(engine, ps, GREEDY, monkeypatch))          # the same prompts again: now they hit
        hit = sum(h for h, _ in engine.blocks.hits.values())
        assert (hit > 0) == caching, f"{hit} prompt tokens served from the cache"
        engine.blocks.clear_cache()
        assert_no_leaks(engine)
    for (t_a, l_a), (t_b, l_b) in zip(outs[:2], outs[2:]):   # (float32 BLAS sums by the chunk's row count)
        assert t_a == t_b
        for a, b in zip(l_a, l_b):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_hit_is_cut_back_to_where_the_window_is_held(swa):
    """Multi-turn chat: the next turn's prompt is the whole conversation so far; the cache kept the local twins of
    the blocks published while they were held (LocalTwins), so it hits up to there. Without the twins the hit is cut
    back to nothing; both give the tokens of an engine without a cache."""
    engine = Engine(swa, num_blocks=96, block_size=4, prefix_caching=True)
    prompt = list(range(40, 75))                                     # 35 tokens
    turn2 = prompt + engine.generate([prompt], GREEDY)[0] + [5, 6, 7]
    want = Engine(swa, num_blocks=96, block_size=4).generate([turn2], GREEDY)
    matched = engine.blocks.cache.peek(turn2)
    assert len(matched) == (35 + 12 - 1) // 4                        # every full block the first turn computed
    assert engine.blocks.usable_hit(turn2, matched) == matched
    # blocks are published (with their twins) as they fill, but the first prompt ran as one chunk: the local blocks
    # before its last window were freed before its commit. A hit ending at block 8 needs blocks 6 and 7: cut to none
    assert engine.blocks.usable_hit(turn2, matched[:8]) == [] and len(engine.blocks.usable_hit(turn2, matched[:9])) == 9
    assert engine.generate([turn2], GREEDY) == want
    engine.blocks.twins.clear()                                      # (the local pool needed them elsewhere)
    assert engine.blocks.usable_hit(turn2 + [9], engine.blocks.cache.peek(turn2 + [9])) == []
    assert engine.generate([turn2 + [9]], GREEDY) == Engine(swa, num_blocks=96, block_size=4).generate(
        [turn2 + [9]], GREEDY)
    assert [h for h, _ in engine.blocks.hits.values()] == [0, len(matched) * 4, 0]


def test_batched_equals_alone(swa, monkeypatch):
    """Batch invariance on the float32 NumPy path: the same tokens, logits within float noise (BLAS may sum in
    another order for another row count: see tests/test_batch_invariance.py)."""
    ps = prompts(n=8, seed=5, lo=5, hi=45)
    together = run(Engine(swa, num_blocks=256, block_size=4, max_batch_tokens=48), ps, GREEDY, monkeypatch)
    for i, p in enumerate(ps):
        alone = run(Engine(swa, num_blocks=64, block_size=4, max_batch_tokens=48), [p], GREEDY, monkeypatch)
        assert alone[0][0] == together[0][i]
        np.testing.assert_allclose(alone[1][0], together[1][i], rtol=1e-4, atol=1e-4)


def test_speculative_decoding_keeps_the_tokens(swa):
    ps = [list(range(10, 20)) * 4, prompts(n=1, seed=6, lo=30, hi=31)[0]]   # a repetitive prompt: n-grams hit
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    plain = Engine(swa, num_blocks=128, block_size=4).generate(ps, params)
    engine = Engine(swa, num_blocks=128, block_size=4, speculative="ngram", draft_k=4)
    assert engine.generate(ps, params) == plain
    assert sum(s.num_accepted for s in engine.stats) > 0, "no draft was accepted: the rewind path went untested"
    assert_no_leaks(engine)


def test_the_local_pool_is_sized_by_the_window_not_the_context(swa):
    engine = Engine(swa, num_blocks=1000, block_size=4, max_batch_tokens=32, max_running=4)
    assert engine.local_pool.num_blocks == local_blocks_bound(W, 4, 4, 32) == 4 * (2 + 2) + 8
    assert engine.pool.k.shape[0] == 1 and engine.local_pool.k.shape[0] == 2    # layer 2 global, 0 and 1 local
    small = Engine(swa, num_blocks=10, block_size=4)
    assert small.local_pool.num_blocks == 10       # never more than the global pool: a local table is no longer


@pytest.mark.parametrize("budget", [256, 5])
def test_numba_attention_masks_by_window(swa, monkeypatch, budget):
    """The numba backend's paged attention (kernels/attention.py) on a windowed model: the dense reference's tokens
    and logits within the kernels' tolerance, through chunked prefill and decode; freeing the blocks behind the
    window changes no bit there either (the kernel never reads before the window)."""
    ps = prompts(n=4, seed=7, lo=10, hi=40)
    results = []
    for free in (True, False):
        engine = Engine(swa, num_blocks=128, block_size=4, max_batch_tokens=budget, backend="numba")
        engine.blocks.free_behind_window = free
        results.append(run(engine, ps, GREEDY, monkeypatch))
        assert_no_leaks(engine)
    (t_free, l_free), (t_keep, l_keep) = results
    assert t_free == t_keep and all(np.array_equal(a, b) for a, b in zip(l_free, l_keep))
    for p, got_t, got_l in zip(ps, t_free, l_free):
        want_t, want_l = reference(swa, p, GREEDY.max_new_tokens)
        assert got_t == want_t
        np.testing.assert_allclose(got_l, want_l, rtol=1e-4, atol=1e-4)


def test_describe_tables_marks_freed_blocks(swa):
    engine = Engine(swa, num_blocks=64, block_size=4)
    engine.add_request(list(range(3, 30)), SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    engine.step()
    text = engine.blocks.describe_tables(engine.running)
    print("\n" + text)
    assert "local layers (window 8)" in text and "local  [., ., ., ., " in text


# --- paged attention with a window, on its own --------------------------------------------------------------

@pytest.mark.parametrize("m", [1, 3, 11])
def test_paged_attention_reads_only_the_window(m):
    """Blocks before the window may be -1 (freed): the result equals dense attention over the whole sequence."""
    rng = np.random.default_rng(m)
    bs, K, N, H, ctx = 4, 2, 4, 8, 29
    nb = blocks_for(ctx, bs)
    k_cache = rng.standard_normal((nb + 3, bs, K, H)).astype(np.float32)
    v_cache = rng.standard_normal((nb + 3, bs, K, H)).astype(np.float32)
    table = rng.permutation(nb + 3)[:nb]
    q = rng.standard_normal((m, N, H)).astype(np.float32)
    first = first_live_block(ctx - m, W, bs)
    freed = np.where(np.arange(nb) < first, -1, table)[None]            # [1, nb] the table after the release
    got = paged_attention(q, k_cache, v_cache, freed, np.array([ctx]), np.array([0, m]), window=W)
    k = k_cache[table].reshape(-1, K, H)[:ctx]
    v = v_cache[table].reshape(-1, K, H)[:ctx]
    q_all = np.zeros((ctx, N, H), np.float32)
    q_all[ctx - m:] = q
    want = dense_window_attention(q_all, k, v, W)[ctx - m:]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # without the window, the freed blocks would be read: refused
    with pytest.raises(ValueError, match="needs .* valid ids"):
        paged_attention(q, k_cache, v_cache, freed, np.array([ctx]), np.array([0, m]))


def test_a_freed_block_inside_the_window_is_refused():
    bs, ctx, m = 4, 29, 1
    first = first_live_block(ctx - m, W, bs)                              # (28 - 8 + 1) // 4 = 5
    table = np.arange(blocks_for(ctx, bs))[None].copy()
    table[0, first] = -1
    with pytest.raises(ValueError, match="sequence 0 has context_len 29"):
        check_block_tables(table, np.array([ctx]), np.array([0, m]), m, 100, bs, window=W)
    table[0, first] = first
    table[0, :first] = -1
    check_block_tables(table, np.array([ctx]), np.array([0, m]), m, 100, bs, window=W)     # fine


@pytest.mark.parametrize("free", [True, False])
def test_the_memory_prediction_is_what_the_block_manager_counts(swa, free):
    """kv_sizing.paged_kv_bytes (the arithmetic docs/sliding-window.md uses for Gemma 3 270M) against the blocks the
    engine's two pools hold once a long prompt is in, on the tiny model."""
    bs, n = 4, 61
    engine = Engine(swa, num_blocks=64, block_size=bs, max_batch_tokens=16)
    engine.blocks.free_behind_window = free
    engine.add_request(list(range(3, 3 + n)), SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    while not engine.running or engine.running[0].num_computed_tokens < n:   # prefill in chunks of 16
        engine.step()
    assert engine.running[0].num_computed_tokens == n
    per_block = 2 * bs * swa.config.n_kv_heads * swa.config.head_dim * 4
    counted = (1 * engine.blocks.allocator.num_used * per_block, 2 * engine.blocks.local.num_used * per_block)
    assert counted == paged_kv_bytes(swa.config, n, bs, free_behind_window=free)
    assert (engine.pool.nbytes // engine.pool.num_blocks) == per_block     # one global layer's K and V per block


@pytest.mark.slow
def test_gemma_pattern_3000_prompt_200_new_tokens():
    """The issue's scale on a tiny model with Gemma 3's layer pattern (five local layers of window 512, then a global
    one; 6 layers, not 18, to keep CI short: the pattern, not the depth, is under test): a 3,000-token prompt plus
    200 new tokens. The local blocks in use stay at the window's size (printed), and the tokens equal a run that
    keeps every block. (Prefix caching on vs off: test_prefix_caching_on_and_off_give_the_same_answers.)"""
    model = tiny_model(seed=3, n_layers=6, max_seq_len=4096, sliding_window=512, sliding_window_pattern=6)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 256, size=3000)]
    params = SamplingParams(temperature=0, max_new_tokens=200, ignore_eos=True)
    bs, most = 16, blocks_for(512 - 1, 16) + 1
    outs = []
    for free in (True, False):
        engine = Engine(model, num_blocks=blocks_for(3200, bs) + 4, block_size=bs, max_batch_tokens=512)
        engine.blocks.free_behind_window = free
        rid = engine.add_request(prompt, params)
        between = []
        while engine.has_unfinished():
            engine.step()
            if engine.running:
                between.append(engine.blocks.local.num_used)
        outs.append(engine.finished[rid].output_ids)
        assert_no_leaks(engine)
        if free:
            print(f"\nlocal blocks in use between steps: at most {max(between)} (window 512 = {512 // bs} blocks "
                  f"of {bs}); peak during a step {engine.blocks.local_peak}; global blocks at the end "
                  f"{blocks_for(3199, bs)}")
            assert max(between) <= most
        else:
            assert max(between) == blocks_for(3199, bs)
    assert outs[0] == outs[1] and len(outs[0]) == 200


def test_a_local_pool_too_small_to_never_run_dry_is_refused(swa):
    with pytest.raises(ValueError, match="num_local_blocks must be at least 24"):
        Engine(swa, num_blocks=1000, block_size=4, max_batch_tokens=32, max_running=4, num_local_blocks=23)
    assert Engine(swa, num_blocks=1000, block_size=4, max_batch_tokens=32, max_running=4,
                  num_local_blocks=30).local_pool.num_blocks == 30


@pytest.mark.parametrize("model", ["swa", "all_local"])
def test_a_prefill_handed_over_continues_exactly(model, request):
    """Lesson 8's disaggregated hand-over on a windowed model: export_kv gathers each layer kind's K/V from its own
    pool (a local layer's freed positions are zeros, never read again), add_prefilled writes each kind into its own
    pool (a local layer only the window's blocks: the rest of its table is -1), and the decode continues with the
    tokens of one engine that did it all. The two engines' block sizes differ, so the window's blocks do too."""
    from tinyserve.orchestrators import adopt_prefilled
    m = request.getfixturevalue(model)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 256, 37)]       # 37: the last block is partial
    got = prefill_and_export(m, prompt, params, block_size=4)
    k, v, expect = got.k, got.v, got.expect
    assert got.seq.local_table[0] == -1                      # the prefill engine freed what fell behind the window
    dec = Engine(m, num_blocks=64, block_size=8)
    rid2 = adopt_prefilled(dec, prompt, params, got.first, k, v)
    held = dec.sequence(rid2).local_table
    assert held[:first_live_block(37, W, 8)] == [-1] * first_live_block(37, W, 8) and min(held[-1:]) >= 0
    dec.run()
    assert dec.finished[rid2].output_ids == expect
    assert_no_leaks(dec)
