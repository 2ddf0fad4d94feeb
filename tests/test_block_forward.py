"""Lesson 11's fast path for a block that is not LLaMA's (kernels/block_forward.py), on a tiny random model with
every Gemma 3 switch on: Q/K norms, norms after attention and MLP, GELU, a scaled embedding, sliding windows with a
RoPE base of their own.

The truth is model.forward over the NumPy reference of the same quantised weights (quant.matmul_reference): with
the same attention the tiles must give the same bits; on the numba backend's paged attention, the same greedy
tokens within the kernels' tolerance; and a row's logits must not depend on what shares its step.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinyserve import backend, gguf_quants, quant
from tinyserve.engine import Engine
from tinyserve.gqa import grouped_attention
from tinyserve.kv_cache import KVCache, forward_with_cache
from tinyserve.quant import quantize_model
from tinyserve.sampling import SamplingParams
from tinyserve.weights import tiny_model

W = 8


def tiny_gemma(seed=0):
    """tiny_model with Gemma 3's switches and the weights they read (random norms near 1)."""
    m = tiny_model(seed=seed, n_layers=3, intermediate_size=128, qk_norm=True, post_norms=True,
                   activation="gelu_tanh", embed_scale=8.0, sliding_window=W, sliding_window_pattern=3,
                   rope_theta_local=100.0)
    rng = np.random.default_rng(seed + 100)
    near_one = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)   # noqa: E731
    cfg = m.config
    layers = [dataclasses.replace(w, q_norm=near_one(cfg.head_dim), k_norm=near_one(cfg.head_dim),
                                  post_attn_norm=near_one(cfg.dim), post_mlp_norm=near_one(cfg.dim))
              for w in m.layers]
    return dataclasses.replace(m, layers=layers)


@pytest.fixture(scope="module")
def gemma_like():
    return tiny_gemma()


def prompts(n=5, seed=0, lo=3, hi=40):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 256, size=int(m))] for m in rng.integers(lo, hi, size=n)]


@pytest.mark.parametrize("mode", ["w8a8-64", "w4a8", "int8"])
def test_tiles_give_the_references_bits(gemma_like, mode):
    """The same attention (lesson 3's grouped attention, windowed on the local layers), so only the matmuls differ:
    the tiles' logits equal the NumPy reference of the same quantised weights bit for bit with int8 activations
    (W8A32's float32 activations sum in another order than NumPy: within 1e-4)."""
    ref = quantize_model(gemma_like, mode)
    fast = backend.set_backend(gemma_like, mode, "numba")
    assert backend.runs_on_kernels(fast) and backend.block_switches(fast)
    ids = prompts(n=1, seed=1, lo=43, hi=44)[0]
    caches = KVCache.allocate(ref.config, 64), KVCache.allocate(ref.config, 64)
    # 40 rows (the fused calls' row loops in parallel: block_layer.ROW_LOOPS_PARALLEL_FROM), then 3 more (serial)
    want, got = ([forward_with_cache(m, c, part, grouped_attention, all_logits=True) for part in (ids[:40], ids[40:])]
                 for m, c in zip((ref, fast), caches))
    want, got = np.concatenate(want), np.concatenate(got)
    assert (fast.fast.fused is None) == (mode == "int8")    # the fused calls ran (W8A32: the reference on the tiles)
    if mode == "int8":
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    else:
        assert np.array_equal(got, want)


GREEDY = SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True)


def test_engine_on_the_fast_path_gives_the_references_tokens(gemma_like):
    """The paged engine on the numba backend (tiles + the windowed Numba attention), chunked prefill and a batch:
    the greedy tokens of the NumPy reference engine of the same quantised weights."""
    ps = prompts()
    fast = backend.set_backend(gemma_like, "w8a8-64", "numba")
    ref = backend.set_backend(gemma_like, "w8a8-64", "numpy")
    got = Engine(fast, num_blocks=128, block_size=4, max_batch_tokens=7).generate(ps, GREEDY)
    want = Engine(ref, num_blocks=128, block_size=4, max_batch_tokens=64).generate(ps, GREEDY)
    assert got == want


def test_a_rows_logits_do_not_depend_on_its_batch(gemma_like, monkeypatch):
    """Batch invariance on the fast path: each prompt's sampled logits, alone and in a batch of five with chunked
    prefill, are the same bits (attention adds in one order, every other step is per row)."""
    from tests.test_sliding_window import run
    fast = backend.set_backend(gemma_like, "w8a8-64", "numba")
    ps = prompts(seed=3, lo=10, hi=45)
    _, batched = run(Engine(fast, num_blocks=256, block_size=4, max_batch_tokens=9), ps, GREEDY, monkeypatch)
    for i, p in enumerate(ps):
        _, (alone,) = run(Engine(fast, num_blocks=64, block_size=4, max_batch_tokens=64), [p], GREEDY, monkeypatch)
        assert np.array_equal(alone, batched[i]), f"prompt {i} differs"


def test_generate_through_the_contiguous_cache_gives_the_engines_tokens(gemma_like):
    """kv_cache.generate (what `tinyserve generate` runs) on the fast path: the windowed layers attend through the
    numba kernel too (dense_attention.window_attention), so its greedy tokens are the paged engine's."""
    from tinyserve.kv_cache import generate
    fast = backend.set_backend(gemma_like, "w8a8-64", "numba")
    for p in prompts(n=3, seed=5, lo=5, hi=30):
        assert generate(fast, p, params=GREEDY) == Engine(fast, num_blocks=64, block_size=4).generate([p], GREEDY)[0]


def test_the_other_switches_give_the_references_bits_too():
    """Qwen's switches on the fused calls (kernels/block_layer.py): Q/K/V biases, Q/K norms, SiLU (NumPy's exp
    between two calls) and no norms after attention and MLP (the residual added inside the matmul's store): the
    same bits as the NumPy reference of the same quantised weights, prefill rows and then decode rows."""
    m = tiny_model(seed=2, n_layers=2, intermediate_size=128, qkv_bias=True, qk_norm=True)
    rng = np.random.default_rng(7)
    cfg = m.config
    small = lambda n: (0.3 * rng.standard_normal(n)).astype(np.float32)               # noqa: E731
    near_one = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)         # noqa: E731
    m = dataclasses.replace(m, layers=[dataclasses.replace(
        w, q_bias=small(cfg.n_heads * cfg.head_dim), k_bias=small(cfg.n_kv_heads * cfg.head_dim),
        v_bias=small(cfg.n_kv_heads * cfg.head_dim), q_norm=near_one(cfg.head_dim), k_norm=near_one(cfg.head_dim))
        for w in m.layers])
    ref = quantize_model(m, "w8a8-64")
    fast = backend.set_backend(m, "w8a8-64", "numba")
    assert backend.block_switches(fast) == ["Q/K/V biases", "Q/K norms"]
    ids = prompts(n=1, seed=4, lo=43, hi=44)[0]
    caches = KVCache.allocate(cfg, 64), KVCache.allocate(cfg, 64)
    want, got = ([forward_with_cache(x, c, part, grouped_attention, all_logits=True) for part in (ids[:40], ids[40:])]
                 for x, c in zip((ref, fast), caches))
    assert fast.fast.fused is not None and np.array_equal(np.concatenate(got), np.concatenate(want))


def _decode_one_by_one(model, ids, n_prompt):
    """Logits of a prefill of ids[:n_prompt] (block_layer's calls: 40 rows), then of each later token alone (decode
    steps of one row: kernels/block_decode.py's regions), then of the last 3 at once: [len(ids), V]."""
    cache = KVCache.allocate(model.config, 64)
    out = [forward_with_cache(model, cache, ids[:n_prompt], grouped_attention, all_logits=True)]
    out += [forward_with_cache(model, cache, [t], grouped_attention, all_logits=True) for t in ids[n_prompt:-3]]
    out.append(forward_with_cache(model, cache, ids[-3:], grouped_attention, all_logits=True))
    return np.concatenate(out)


@pytest.mark.parametrize("mode", ["w8a8-64", "w4a8"])
def test_decode_regions_give_the_references_bits(gemma_like, mode, monkeypatch):
    """Decode steps run as two parallel regions a layer whose threads meet at barriers (kernels/block_decode.py):
    one row and three rows a step give the NumPy reference's bits, and the regions did run."""
    _assert_regions_decode_the_references_bits(gemma_like, mode, 2, monkeypatch)


def _assert_regions_decode_the_references_bits(model, mode, seed, monkeypatch):
    """A prompt's decode steps of one row, then three, through kernels/block_decode.py's regions (which must run)
    give the logits of the NumPy reference over the same quantised weights, bit for bit. Returns the fast model."""
    from tinyserve.kernels import block_decode
    ref = quantize_model(model, mode)
    fast = backend.set_backend(model, mode, "numba")
    calls = []
    region_b = block_decode.region_b
    monkeypatch.setattr(block_decode, "region_b", lambda *a: (calls.append(a[3].shape[0]), region_b(*a)))
    ids = prompts(n=1, seed=seed, lo=50, hi=51)[0]
    want, got = _decode_one_by_one(ref, ids, 40), _decode_one_by_one(fast, ids, 40)
    assert np.array_equal(got, want)
    assert sorted(set(calls)) == [1, 3], f"region calls by rows: {sorted(set(calls))}"
    return fast


def test_decode_regions_on_5_bit_weights_give_the_references_bits(monkeypatch):
    """Gemma's block with q, k, v, gate and up Q5_0 as a GGUF holds them (the 5-bit tile, up with two int8 planes)
    and o and down Q4_1 (the nibble tile, where Gemma 3 270M's file has Q4_K): decode steps of one row (both planes as
    the two rows of one tile) and of three rows through the regions give the NumPy reference's bits. These are the
    kinds of most of that file's layers, so the real model's tests reuse the functions compiled here."""
    from tinyserve.gguf_file import LAYER_TENSORS, unpermute_rope_rows
    from tests.test_gguf_tiles import info
    base = tiny_gemma(seed=3)
    cfg, names, tensors, layers = base.config, {f: n for n, f in LAYER_TENSORS.items()}, {}, []
    for i, w in enumerate(base.layers):
        new = {}
        for j, f in enumerate(quant.MATRICES):
            D, O = getattr(w, f).shape
            t = info("Q4_1" if f in ("wo", "w_down") else "Q5_0", O, D, seed=10 * i + j, name=f"blk.{i}.{names[f]}")
            tensors[t.name] = t
            v = gguf_quants.dequantize(t.raw, t.type_name, t.shape)                 # [O, D]
            if f in ("wq", "wk") and cfg.arch == "llama":
                v = unpermute_rope_rows(v, cfg.n_heads if f == "wq" else cfg.n_kv_heads)
            new[f] = np.ascontiguousarray(v.T)
        layers.append(dataclasses.replace(w, **new))
    fast = _assert_regions_decode_the_references_bits(dataclasses.replace(base, layers=layers, gguf_tensors=tensors),
                                                      "gguf", 4, monkeypatch)
    up = fast.fast.fused[0]
    kinds = [type(m).__name__ for m in (up.qkv, up.o, up.gate_up, up.down)]
    assert kinds == ["S5A8Weights", "W4A8Weights", "S5A8Weights", "W4A8Weights"] and up.plane_lo < up.plane_hi


def test_regions_whose_threads_do_not_meet_fall_back_to_the_calls(gemma_like, monkeypatch):
    """A region told of 2 threads while Numba runs 1 times out at a barrier: the step runs again on block_layer's
    calls (same logits), one warning says why, and later steps do not try again."""
    from tinyserve.kernels import block_forward as bf
    fast = backend.set_backend(gemma_like, "w8a8-64", "numba")
    ref = quantize_model(gemma_like, "w8a8-64")
    ids = prompts(n=1, seed=6, lo=12, hi=13)[0]
    caches = KVCache.allocate(ref.config, 64), KVCache.allocate(ref.config, 64)
    for m, c in zip((ref, fast), caches):
        forward_with_cache(m, c, ids, grouped_attention)
    want = forward_with_cache(ref, caches[0], [7], grouped_attention)
    monkeypatch.setattr(bf, "threads", lambda: 2)
    monkeypatch.setattr(bf, "TIMEOUT_CYCLES", 2_000_000)
    monkeypatch.setattr(bf, "_regions_disabled", None)
    import numba
    old = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with pytest.warns(RuntimeWarning, match="did not meet"):
            got = forward_with_cache(fast, caches[1], [7], grouped_attention)
    finally:
        numba.set_num_threads(old)
    assert np.array_equal(got, want)
    assert bf._regions_disabled is not None and not bf.block_decode_usable(1, None)


def _region_forks(monkeypatch):
    """Spy on kernels/block_decode.py's regions: [(layout given, parallel regions run)] per decode step (each region
    is one parallel loop: one fork and join of the thread pool)."""
    from tinyserve.kernels import block_decode, block_forward as bf
    steps, count = [], [0]
    for name in ("region_a", "region_b", "region_layer"):
        real = getattr(block_decode, name)
        monkeypatch.setattr(block_decode, name, lambda *a, _real=real: (count.__setitem__(0, count[0] + 1), _real(*a)))
    real_steps = bf._decode_regions

    def spy(*a, **kw):
        count[0] = 0
        out = real_steps(*a, **kw)
        steps.append((a[-1] is not None, count[0]))
        return out
    monkeypatch.setattr(bf, "_decode_regions", spy)
    return steps


def test_a_layer_in_one_region_gives_the_bits_of_attention_between_two(gemma_like, monkeypatch):
    """Given where the K/V live (a KVLayout: the engine's two pools, local and global, or the contiguous cache), a
    decode step runs each layer as one parallel region that writes its K/V and attends between barriers
    (block_decode.region_layer): L + 1 forks a step, where attention called between two regions a layer takes
    2 L + 1. Same sampled logits, bit for bit; chunked prefill frees local blocks behind the window meanwhile."""
    from tinyserve import engine as engine_mod, kv_cache
    from tests.test_sliding_window import run
    fast = backend.set_backend(gemma_like, "w8a8-64", "numba")
    L = fast.config.n_layers
    ps = prompts(n=3, seed=8, lo=10, hi=30)
    steps = _region_forks(monkeypatch)
    _, got = run(Engine(fast, num_blocks=128, block_size=4, max_batch_tokens=7), ps, GREEDY, monkeypatch)
    assert steps and set(steps) == {(True, L + 1)}, f"(layout, forks) per decode step: {sorted(set(steps))}"
    real_forward = engine_mod.forward
    monkeypatch.setattr(engine_mod, "forward", lambda *a, kv_layout=None, **kw: real_forward(*a, **kw))
    steps.clear()
    _, want = run(Engine(fast, num_blocks=128, block_size=4, max_batch_tokens=7), ps, GREEDY, monkeypatch)
    assert set(steps) == {(False, 2 * L + 1)}, f"(layout, forks) per decode step: {sorted(set(steps))}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert np.array_equal(g, w), f"prompt {i} differs"
    # the contiguous cache: one row a step, then 3 rows of one sequence at once (they read each other's K/V)
    ids = prompts(n=1, seed=9, lo=30, hi=31)[0]
    outs = []
    for with_layout in (True, False):
        if not with_layout:
            real = kv_cache.model_forward
            monkeypatch.setattr(kv_cache, "model_forward", lambda *a, kv_layout=None, **kw: real(*a, **kw))
        steps.clear()
        cache = KVCache.allocate(fast.config, 64)
        out = [forward_with_cache(fast, cache, ids[:12], all_logits=True)]
        out += [forward_with_cache(fast, cache, [t]) for t in ids[12:-3]]
        out.append(forward_with_cache(fast, cache, ids[-3:], all_logits=True))
        outs.append(np.concatenate(out))
        assert {s[0] for s in steps} == {with_layout}
    assert np.array_equal(outs[0], outs[1])
