"""The fused decode step (kernels/decode_step.py) computes what the three-call path computes, and fails safe.

What must hold:
- the spin barrier keeps the threads in step: no thread reads a phase's results before every thread wrote them;
- one fused step = one three-call step on the same cache (paged blocks and the contiguous KVCache): the logits and
  the K/V written into the cache. W8A32 runs the very same code per element (matmul tiles, norms, SiLU on exp32,
  the decode attention item): equal to ~1e-6. W8A8 (and W4A8): bit-identical, both computing SiLU with
  fast_exp.exp32 (forward.silu_exp = None); with NumPy's exp there instead (np.exp: the NumPy reference's bits), close;
- the strategies really take it: kv_cache decode and the Engine's decode-only steps (greedy tokens as before), and
  speculative verify steps, whose rows read each other's K/V: row j equals a decode step at that position;
- threads that do not meet (here: a step told it has 2 threads while Numba runs 1) give up at the deadline, warn
  once, and the step is run the three-call way with the same result.
"""
from __future__ import annotations

import contextlib

import numba
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from numba import njit, prange

import tinyserve as ts
from tinyserve import backend, kv_cache, quant, speculative
from tinyserve.attention_backends import KVLayout
from tinyserve.drafters import ModelDrafter
from tinyserve.engine import Engine
from tinyserve.kernels import decode_step, forward as fast
from tinyserve.kernels.attention import paged_attention_numba_unchecked
from tinyserve.kernels.spin import FAILED, SPIN_CYCLES, SYNC_SIZE, atomic_load, atomic_store, barrier, cycle_counter
from tinyserve.paged import write_kv_unchecked
from tinyserve.sampling import SamplingParams

GREEDY12 = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=12)


@pytest.fixture(scope="module")
def tiny_fast():
    """mode -> the tiny model quantised, on the numba backend; for w8a8-64 a tiny model whose matrices' inputs
    split into blocks of 64 (D = 128: 2 blocks, F = 192: 3; the default tiny model's F = 160 does not)."""
    out = {}
    for mode in ("int8", "w8a8", "w8a8-64", "w4a8"):
        base = ts.tiny_model(seed=0, **({"dim": 128, "intermediate_size": 192} if mode == "w8a8-64" else {}))
        out[mode] = backend.set_backend(quant.quantize_model(base, mode), mode, "numba")
    return out


def _require_fused(T, layout, rows):
    assert decode_step.usable(T, layout, rows), (
        f"the fused decode step is not usable here (numba threading layer: {numba.threading_layer()!r}; it needs "
        "'omp', i.e. libgomp): this test would only compare the three-call path with itself")


# --- the barrier -------------------------------------------------------------------------------------------------

@njit(cache=True)
def _phases_thread(tid, n_threads, sync, n_phases, stamps, seen):
    """Each thread writes its phase number, meets the others, then reads every thread's slot: all must show the
    phase just finished (a barrier that let a thread through early would show an older one)."""
    for phase in range(n_phases):
        stamps[tid] = phase
        if not barrier(sync, n_threads, 10_000_000_000):
            return
        for other in range(n_threads):
            if stamps[other] != phase:
                seen[tid] += 1
        if not barrier(sync, n_threads, 10_000_000_000):       # nobody writes the next phase before all have read
            return


@njit(cache=True, parallel=True)
def _phases(n_threads, sync, n_phases, seen):
    stamps = np.full(n_threads, -1, np.int64)
    for tid in prange(n_threads):          # (a `return` inside a prange body would make the loop serial)
        _phases_thread(tid, n_threads, sync, n_phases, stamps, seen)


def test_barrier_keeps_the_threads_in_step():
    n = numba.get_num_threads()
    sync, seen = np.zeros(SYNC_SIZE, np.int64), np.zeros(n, np.int64)
    _phases(n, sync, 2000, seen)
    assert sync[FAILED] == 0 and seen.sum() == 0, f"{seen.sum()} stale reads, failed={sync[FAILED]}"


@njit(cache=True, parallel=True)
def _late_partner(n_threads, sync, delay, arrive, leave):
    for tid in prange(n_threads):
        if tid == 0:                       # thread 0 comes `delay` cycles after every other thread is waiting
            for other in range(1, n_threads):
                while atomic_load(arrive, other) == 0:
                    pass
            start = cycle_counter()
            while cycle_counter() - start < delay:
                pass
        atomic_store(arrive, tid, cycle_counter())
        ok = barrier(sync, n_threads, 10_000_000_000)
        atomic_store(leave, tid, cycle_counter() if ok else -1)


def test_barrier_waits_for_a_late_partner_past_the_spin_budget():
    """After SPIN_CYCLES a waiting thread yields its core on every turn (kernels/spin.py): it must still wait, and
    let everyone through together when the late one comes."""
    n = numba.get_num_threads()
    if n < 2:
        pytest.skip("one Numba thread: nobody waits at a barrier")
    sync, arrive, leave = np.zeros(SYNC_SIZE, np.int64), np.zeros(n, np.int64), np.zeros(n, np.int64)
    _late_partner(n, sync, 4 * SPIN_CYCLES, arrive, leave)
    assert sync[FAILED] == 0 and (leave > 0).all(), f"a barrier failed: left at {leave}"
    assert (arrive[1:] < arrive[0] - 3 * SPIN_CYCLES).all(), f"the others did not wait long: arrived at {arrive}"
    assert (leave >= arrive.max()).all(), (
        f"a thread left the barrier (cycles {leave}) before the late one arrived ({arrive[0]})")


def test_barrier_gives_up_when_a_partner_never_comes():
    sync = np.zeros(SYNC_SIZE, np.int64)
    assert not barrier(sync, 2, 1_000_000)          # one caller of two: waits ~1 M cycles (~0.5 ms), then fails
    assert sync[FAILED] == 1
    assert not barrier(sync, 2, 1_000_000)          # and every later barrier of the step fails at once


# --- one step, fused and not ---------------------------------------------------------------------------------------

def _paged_case(model, B, ctx, bs, seed):
    """A pool with random history for B sequences (block tables shuffled over the pool), and their next tokens."""
    cfg = model.config
    rng = np.random.default_rng(seed)
    per_seq = [-(-c // bs) for c in ctx]
    nb = sum(per_seq) + 3
    ids = rng.permutation(nb)
    tables = np.full((B, max(per_seq)), -1, np.int64)
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = ids[start:start + n]
        start += n
    shape = (cfg.n_layers, nb, bs, cfg.n_kv_heads, cfg.head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    tokens = rng.integers(0, cfg.vocab_size, B)
    return k, v, tables, np.array(ctx, np.int64), tokens


def _paged_step(model, k_pool, v_pool, tables, ctx, tokens, fused):
    """One decode step over the pool, the way the Engine runs it: logits [B, V]; K/V written into the pool."""
    L, nb, bs, K, H = k_pool.shape
    B = len(tokens)
    pos = ctx - 1
    blocks, offsets = tables[np.arange(B), pos // bs], pos % bs
    starts = np.arange(B + 1, dtype=np.int64)

    def attention(layer, q, k, v):
        write_kv_unchecked(k_pool[layer], v_pool[layer], blocks, offsets, k, v)
        return paged_attention_numba_unchecked(q, k_pool[layer], v_pool[layer], tables, ctx, starts)
    layout = None
    if fused:
        layout = KVLayout(k_pool.reshape(L, nb * bs, K, H), v_pool.reshape(L, nb * bs, K, H), tables, bs, ctx)
        _require_fused(B, layout, np.arange(B))
    return fast.fast_forward(model, tokens, pos, attention, logit_rows=np.arange(B), kv_layout=layout)


@settings(max_examples=25)
@given(B=st.integers(1, decode_step.MAX_ROWS), bs=st.sampled_from([1, 4, 16]), seed=st.integers(0, 10**6),
       ctx=st.lists(st.integers(1, 40), min_size=decode_step.MAX_ROWS, max_size=decode_step.MAX_ROWS))
# always: a step whose threads split the rows' norms and SwiGLU (SPLIT_ROWS a thread), and one that does not
@example(B=decode_step.MAX_ROWS, bs=4, seed=7, ctx=list(range(3, 3 + 2 * decode_step.MAX_ROWS, 2)))
@example(B=decode_step.SPLIT_ROWS - 1, bs=16, seed=8, ctx=[40] * decode_step.MAX_ROWS)
def test_fused_step_equals_three_calls_on_paged_blocks(tiny_fast, B, bs, seed, ctx):
    for mode, model in tiny_fast.items():
        k, v, tables, lens, tokens = _paged_case(model, B, ctx[:B], bs, seed)
        k3, v3 = k.copy(), v.copy()
        want = _paged_step(model, k3, v3, tables, lens, tokens, fused=False)
        if quant.is_w8a8(mode):
            with pytest.MonkeyPatch.context() as mp:      # the three-call path with NumPy's exp (the reference's)
                mp.setattr(fast, "silu_exp", np.exp)
                want_np = _paged_step(model, k.copy(), v.copy(), tables, lens, tokens, fused=False)
        got = _paged_step(model, k, v, tables, lens, tokens, fused=True)
        if quant.is_w8a8(mode):
            assert np.array_equal(got, want), f"max diff {np.abs(got - want).max():.3g}"
            assert np.array_equal(k, k3) and np.array_equal(v, v3)
            # NumPy's exp vs exp32 (<= 2e-7 relative) can move an activation across an int8 rounding boundary
            np.testing.assert_allclose(got, want_np, atol=0.05 * np.abs(want_np).max())
        else:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            np.testing.assert_allclose(k, k3, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(v, v3, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["int8", "w8a8", "w8a8-64", "w4a8"])
def test_kv_cache_decode_takes_the_fused_step(tiny_fast, mode, monkeypatch):
    model = tiny_fast[mode]
    prompt = [5, 17, 99, 3, 42, 250, 7, 7, 128]
    calls = []
    real = decode_step.decode_step
    monkeypatch.setattr(decode_step, "decode_step", lambda *a: calls.append(1) or real(*a))
    runs = {}
    for fused in (True, False):
        with contextlib.nullcontext() if fused else decode_step.three_call_path():
            cache = kv_cache.KVCache.allocate(model.config, 40)
            rows = [kv_cache.prefill(model, cache, prompt)]
            for tok in [7, 200, 2, 19, 88, 88, 1]:
                rows.append(kv_cache.forward_with_cache(model, cache, [tok])[0])
        runs[fused] = (np.array(rows), cache.k[:, :cache.length].copy(), cache.v[:, :cache.length].copy())
    assert len(calls) == 7, "every decode step should have run fused"
    # the contiguous cache's three-call path attends with the few-rows kernel, the fused step with the paged decode
    # item: both add in 16 lanes, but nothing promises the same order, hence a tolerance even for W8A8
    for got, want in zip(runs[True], runs[False]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("mode", ["int8", "w8a8", "w8a8-64", "w4a8"])
def test_engine_decode_steps_run_fused_with_the_same_tokens(tiny_fast, mode, monkeypatch):
    model = tiny_fast[mode]
    prompts = [[5, 17, 99, 3], [3, 1, 4, 1, 5, 9, 2, 6], [250], [8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8]]
    calls = []
    real = decode_step.decode_step
    monkeypatch.setattr(decode_step, "decode_step", lambda m, t, lay: calls.append(len(t)) or real(m, t, lay))
    got = Engine(model, num_blocks=40, block_size=4).generate(prompts, GREEDY12)
    assert calls and max(calls) == 4, f"fused steps of {sorted(set(calls))} rows; expected batches of up to 4"
    with decode_step.three_call_path():
        assert got == Engine(model, num_blocks=40, block_size=4).generate(prompts, GREEDY12)


@pytest.mark.parametrize("mode", ["int8", "w8a8", "w8a8-64", "w4a8"])
def test_verify_rows_run_fused_and_equal_decode_steps(tiny_fast, mode, monkeypatch):
    """A speculative verify (k + 1 rows of one sequence, every row's logits) runs as one fused step whose rows read
    each other's K/V; row j gets exactly what a decode step at that position gets (the same per-row code)."""
    model = tiny_fast[mode]
    prompt, drafted = [5, 17, 99, 3, 42, 250, 7], [7, 200, 2, 19]
    calls = []
    real = decode_step.decode_step
    monkeypatch.setattr(decode_step, "decode_step", lambda m, t, lay: calls.append(len(t)) or real(m, t, lay))
    cache = kv_cache.KVCache.allocate(model.config, 16)
    kv_cache.prefill(model, cache, prompt)
    steps = np.concatenate([kv_cache.forward_with_cache(model, cache, [tok]) for tok in drafted])
    k_steps, v_steps = cache.k[:, :cache.length].copy(), cache.v[:, :cache.length].copy()
    cache.rewind(len(drafted))
    verify = kv_cache.forward_with_cache(model, cache, drafted, all_logits=True)
    assert calls == [1, 1, 1, 1, 4], f"fused steps of {calls} rows: the 4-row verify should have run fused"
    np.testing.assert_array_equal(verify, steps, err_msg="verify row j != the decode step at position j")
    np.testing.assert_array_equal(cache.k[:, :cache.length], k_steps)
    np.testing.assert_array_equal(cache.v[:, :cache.length], v_steps)


@pytest.mark.parametrize("mode", ["int8", "w8a8-64", "w4a8"])
def test_engine_verify_steps_run_fused_with_the_plain_greedy_tokens(tiny_fast, mode, monkeypatch):
    """The Engine's verify steps (one sequence's k + 1 rows, here beside other sequences' decode rows) take the
    fused step when they fit, and speculation still decodes plain decoding's greedy tokens."""
    model = tiny_fast[mode]
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], [3, 1, 4, 1, 5, 9, 2, 6]]
    calls = []
    real = decode_step.decode_step
    monkeypatch.setattr(decode_step, "decode_step", lambda m, t, lay: calls.append(len(t)) or real(m, t, lay))
    plain = Engine(model, num_blocks=40, block_size=4).generate(prompts, GREEDY12)
    calls.clear()
    spec = Engine(model, num_blocks=40, block_size=4, speculative="ngram", draft_k=2)
    assert spec.generate(prompts, GREEDY12) == plain
    drafted = [s.num_drafted for s in spec.stats]
    assert any(drafted), "the n-gram drafter drafted nothing: the test does not exercise verification"
    assert any(n > len(prompts) for n in calls), f"fused steps of {sorted(set(calls))} rows: no verify ran fused"


def test_speculative_loop_verifies_in_the_fused_step(tiny_fast, monkeypatch):
    """speculative.generate_stream on a numba model takes kv_cache's default attention, so its verifies of up to 4
    rows run fused (its default used to be NumPy's grouped attention: every verify took the slow path)."""
    from tinyserve import speculative
    from tinyserve.drafters import NgramDrafter
    model = tiny_fast["int8"]
    calls = []
    real = decode_step.decode_step
    monkeypatch.setattr(decode_step, "decode_step", lambda m, t, lay: calls.append(len(t)) or real(m, t, lay))
    prompt = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    stats = speculative.SpecStats()
    out = speculative.generate(model, prompt, params=GREEDY12, drafter=NgramDrafter(), k=3, stats=stats)
    assert len(out) == 12 and stats.drafted > 0, "the n-gram drafter drafted nothing: nothing was verified"
    assert any(n > 1 for n in calls), f"fused steps of {sorted(set(calls))} rows: no verify ran fused"


def test_threads_that_do_not_meet_fall_back_to_the_three_call_path(tiny_fast, monkeypatch):
    model = tiny_fast["int8"]
    prompt = [5, 17, 99, 3, 42]
    cache = kv_cache.KVCache.allocate(model.config, 16)
    kv_cache.prefill(model, cache, prompt)
    snapshot = (cache.k.copy(), cache.v.copy(), cache.length)
    with decode_step.three_call_path():
        want = kv_cache.forward_with_cache(model, cache, [9])

    cache.k[:], cache.v[:], cache.length = snapshot
    monkeypatch.setattr(decode_step, "threads", lambda: 2)          # the kernel is told 2 threads ...
    monkeypatch.setattr(decode_step, "TIMEOUT_CYCLES", 2_000_000)   # ... waits ~1 ms for the second ...
    monkeypatch.setattr(decode_step, "_disabled_reason", None)
    old = numba.get_num_threads()
    numba.set_num_threads(1)                                        # ... which never comes: Numba runs 1
    try:
        with pytest.warns(RuntimeWarning, match="did not meet"):
            got = kv_cache.forward_with_cache(model, cache, [9])
    finally:
        numba.set_num_threads(old)
    np.testing.assert_array_equal(got, want)                        # the step ran again, the three-call way
    assert decode_step._disabled_reason is not None
    assert not decode_step.usable(1, KVLayout(cache.k, cache.v, np.zeros((1, 1), np.int64), 16, np.array([7])),
                                  None)                             # and later steps do not try again


def test_a_fused_step_that_does_not_compile_falls_back_with_one_warning(tiny_fast, monkeypatch):
    """A CPU whose fused step fails to compile (an intrinsic its LLVM backend lacks) still decodes: the three-call
    path takes the step, one warning says why, and later steps do not try again."""
    model = tiny_fast["int8"]
    cache = kv_cache.KVCache.allocate(model.config, 16)
    kv_cache.prefill(model, cache, [5, 17, 99, 3, 42])
    snapshot = (cache.k.copy(), cache.v.copy(), cache.length)
    with decode_step.three_call_path():
        want = kv_cache.forward_with_cache(model, cache, [9])
    cache.k[:], cache.v[:], cache.length = snapshot

    class Uncompilable:                                             # a kernel whose first compile fails
        signatures: list = []

        def __call__(self, *args):
            raise numba.core.errors.LoweringError("Cannot select: intrinsic %llvm.x86.sse2.pause")
    monkeypatch.setattr(decode_step, "_decode_step_kernel", Uncompilable())
    monkeypatch.setattr(decode_step, "_disabled_reason", None)
    with pytest.warns(RuntimeWarning, match="did not compile") as record:
        got = kv_cache.forward_with_cache(model, cache, [9])
        kv_cache.forward_with_cache(model, cache, [10])             # the next step: no second warning
    assert len([w for w in record if "did not compile" in str(w.message)]) == 1
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [None, np.array([0]), np.array([1, 0])])
def test_usable_only_for_steps_it_can_run(tiny_fast, rows):
    model = tiny_fast["int8"]
    kv_cache.generate(model, [1, 2, 3], 2)                          # a parallel kernel has run: the layer is known
    cache = kv_cache.KVCache.allocate(model.config, 8)
    one = KVLayout(cache.k, cache.v, np.zeros((1, 1), np.int64), 8, np.array([3]))
    two = KVLayout(cache.k, cache.v, np.zeros((2, 1), np.int64), 8, np.array([3, 4]))
    if rows is None or len(rows) == 1:
        assert decode_step.usable(1, one, rows) == (numba.threading_layer() == "omp")
    assert not decode_step.usable(2, one, rows)                     # a layout of 1 row for a step of 2
    assert not decode_step.usable(1, None, rows)                    # no layout: custom attention
    assert not decode_step.usable(2, two, np.array([1, 0]))         # logits wanted in another order
    big = decode_step.MAX_ROWS + 1
    assert not decode_step.usable(big, KVLayout(cache.k, cache.v, np.zeros((big, 1), np.int64), 8,
                                                np.full(big, 3)), None)


@pytest.mark.parametrize("mode", ["w8a8-64", "w4a8"])
def test_a_speculative_verify_of_up_to_max_rows_runs_fused(tiny_fast, mode, monkeypatch):
    """The k + 1 rows of a verify (k + 1 <= MAX_ROWS) run as one fused step, whose every row is the decode step's at
    that position: with the three-call path computing SiLU's exp as the fused step does (the default), speculative
    greedy decoding gives plain greedy decoding's tokens exactly."""
    model = tiny_fast[mode]
    calls = []
    real = decode_step.decode_step
    monkeypatch.setattr(decode_step, "decode_step", lambda m, t, lay: calls.append(len(t)) or real(m, t, lay))
    prompt = [5, 17, 99, 3, 42, 250, 7, 7, 128, 60] * 3
    k = decode_step.MAX_ROWS - 1
    # the prefill gives the first token; then room for one whole verify of k drafts (k + 1 tokens)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_new_tokens=1 + decode_step.MAX_ROWS)
    want = kv_cache.generate(model, prompt, params=params)
    calls.clear()
    # the target drafting for itself: every draft is whole and accepted, so the verifies have k + 1 rows
    got = speculative.generate(model, prompt, params=params, drafter=ModelDrafter(model, target=model), k=k)
    assert got == want
    assert max(calls) == k + 1, f"verify steps of {sorted(set(calls))} rows ran fused; expected one of {k + 1}"


def test_the_compiled_entry_is_kept_and_computes_what_the_dispatcher_does(tiny_fast, monkeypatch):
    """decode_step._run_kernel calls the compiled entry the dispatcher picked on the first step (the dispatcher's
    typing of the named tuples costs a share of a batch-1 step); the logits are the dispatcher's, bit for bit."""
    model = tiny_fast["w8a8"]
    kv_cache.generate(model, [1, 2, 3], 2)                          # a parallel kernel has run: the layer is known
    cache = kv_cache.KVCache.allocate(model.config, 16)
    kv_cache.prefill(model, cache, [5, 17, 99, 3, 42])
    snapshot = (cache.k.copy(), cache.v.copy(), cache.length)
    _require_fused(1, kv_cache.fused_step_layout(model, cache, 1, True, None), None)
    model.fast.decode_entries.clear()
    kept = [kv_cache.forward_with_cache(model, cache, [t]) for t in (9, 10, 11)]
    assert len(model.fast.decode_entries) == 1
    cache.k[:], cache.v[:], cache.length = snapshot
    monkeypatch.setattr(decode_step, "_decode_step_kernel", lambda *args: decode_step._KERNEL(*args))
    dispatched = [kv_cache.forward_with_cache(model, cache, [t]) for t in (9, 10, 11)]
    for a, b in zip(kept, dispatched):
        np.testing.assert_array_equal(a, b)
    c, f = np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32).T      # same dtype and shape, other layouts
    assert decode_step._type_key(c) != decode_step._type_key(f)
