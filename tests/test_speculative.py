"""Lesson 6: speculative decoding on the contiguous KV cache.

Greedy: token-identical to kv_cache.generate for every drafter and k. Stochastic: the output distribution is the
target's (chi-square over seeded runs with a deliberately bad drafter), and the test catches the two classic wrong
rules. Rollback: contiguous and paged rewind at 0, inside a block, across blocks and all the way.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import kv_cache as kc
from tinyserve import naive
from tinyserve import speculative as sp
from tinyserve.drafters import Draft, ModelDrafter, NgramDrafter, draw, early_exit_model, make_drafter
from tinyserve.paged import BlockAllocator
from tinyserve.roofline import speculative_tokens_per_step
from tinyserve.sampling import SamplingParams, probabilities

GREEDY = SamplingParams(temperature=0)
KS = (1, 2, 4, 8)


def tiny_drafters(model):
    """One of each kind, fresh per request: prompt lookup, early exit after 1 of 2 layers, and a separate cheaper
    model (a different random tiny model stands in for the int8 copy: a draft model that mostly disagrees)."""
    return {
        "ngram": lambda: NgramDrafter(),
        "early-exit": lambda: make_drafter("early-exit", model, early_exit_layers=1),
        "draft": lambda: make_drafter("draft", model, draft_model=ts.tiny_model(seed=7)),
    }


def prompts(seed=0, lengths=(1, 6, 40)):
    rng = np.random.default_rng(seed)
    # a repeated chunk gives the n-gram drafter something to find
    out = [rng.integers(3, 256, n).tolist() for n in lengths]
    return out + [out[1] * 4]


# --- greedy: token-identical ---------------------------------------------------------------------------------

@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("kind", ["ngram", "early-exit", "draft"])
def test_greedy_speculative_equals_kv_cache_greedy_tiny(tiny, kind, k):
    make = tiny_drafters(tiny)[kind]
    for ids in prompts():
        stats = sp.SpecStats()
        out = sp.generate(tiny, ids, 30, GREEDY, drafter=make(), k=k, stats=stats)
        assert out == kc.generate(tiny, ids, 30, GREEDY), f"{kind}, k={k}, prompt of {len(ids)}"
        assert stats.emitted == len(out) - 1 and stats.steps <= len(out)     # the first token is the prefill's
        assert all(d <= k for d in stats.ks)


@pytest.mark.parametrize("k", KS)
def test_int8_copy_of_the_target_drafts_well_and_changes_nothing(tiny, k):
    # lesson 7's int8 weights (NumPy reference here) as the draft model: the same tokens, and most drafts accepted
    from tinyserve.backend import set_backend
    int8 = set_backend(tiny, "int8", "numpy")
    ids = prompts()[2]
    stats = sp.SpecStats()
    out = sp.generate(tiny, ids, 30, GREEDY, drafter=make_drafter("int8", tiny, draft_model=int8), k=k, stats=stats)
    assert out == kc.generate(tiny, ids, 30, GREEDY)
    assert stats.alpha > 0.8, f"int8 rounding should rarely change the argmax (α = {stats.alpha:.2f})"


def test_a_drafter_that_is_the_target_is_always_accepted(tiny):
    # the target drafting for itself: α = 1, so every step yields k + 1 tokens (the formula's best case)
    ids = prompts()[2]
    for params in (GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=3)):
        stats = sp.SpecStats()
        # the prefill yields the first token, then 5 verify steps of 5
        out = sp.generate(tiny, ids, 26, params, drafter=ModelDrafter(tiny, target=tiny), k=4, stats=stats)
        assert len(out) == 26 and stats.alpha == 1.0 and stats.rejected == 0
        assert stats.steps == 5 and stats.tokens_per_step == speculative_tokens_per_step(1.0, 4)
        if params.greedy:
            assert out == kc.generate(tiny, ids, 26, params)


def test_greedy_with_repetition_penalty_is_identical(tiny):
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    for ids in prompts(seed=1):
        for kind, make in tiny_drafters(tiny).items():
            assert sp.generate(tiny, ids, 25, params, drafter=make(), k=3) == kc.generate(tiny, ids, 25, params), kind


def test_adaptive_k_greedy_is_identical_and_moves_k(tiny):
    ids = prompts()[3]
    stats = sp.SpecStats()
    # the target drafting for itself, declared free: always accepted, nothing to lose by drafting more
    free_oracle = ModelDrafter(tiny, target=tiny, cost=0.0)
    out = sp.generate(tiny, ids, 40, GREEDY, drafter=free_oracle, k=8, adaptive=True, stats=stats)
    assert out == kc.generate(tiny, ids, 40, GREEDY)
    assert stats.ks[0] < 8 and max(stats.ks) == 8, f"always accepted: k should climb to k_max, got {stats.ks}"
    # the same oracle at its true cost (a whole target forward per token) can never pay for itself: it decodes
    # plainly and drafts one token every 8th step only, to keep measuring α
    honest = sp.SpecStats()
    out = sp.generate(tiny, ids, 40, GREEDY, drafter=ModelDrafter(tiny, target=tiny), k=8, adaptive=True,
                      stats=honest)
    assert out == kc.generate(tiny, ids, 40, GREEDY)
    assert set(honest.ks) == {0, 1} and honest.ks.count(1) <= len(honest.ks) // 8 + 1
    bad = sp.SpecStats()
    sp.generate(tiny, ids, 40, GREEDY, drafter=make_drafter("draft", tiny, draft_model=ts.tiny_model(seed=7)),
                k=8, adaptive=True, stats=bad)
    assert bad.alpha < 0.5 and max(bad.ks[3:]) <= 2, f"rarely accepted: k should stay small, got {bad.ks}"


def test_adaptive_k_follows_the_roofline_formula():
    control = sp.AdaptiveK(k_max=8, draft_cost=0.0)
    assert control.alpha == 0.5
    for _ in range(30):
        control.update(4, 4)                 # all accepted
    assert control.alpha > 0.95 and control.next_k() >= 6
    for _ in range(30):
        control.update(4, 0)                 # first token rejected every time
    # α ~ 0.15: with the roofline's nearly free verify step one draft token still pays (1.15 tokens for 1.05)...
    assert control.alpha < 0.2 and control.next_k() == 1
    control.draft_cost = 0.3                 # ... but not when each draft token costs 0.3 of a step
    assert control.next_k() == 0, "drafting loses: decode plainly"
    assert [control.next_k() for _ in range(7)] == [0] * 6 + [1], "but probe every 8th step"
    before = control.alpha
    control.update(0, 0)                     # nothing drafted: no evidence either way
    assert control.alpha == before
    expensive = sp.AdaptiveK(k_max=8, draft_cost=0.5, accepted=9, rejected=1)
    cheap = sp.AdaptiveK(k_max=8, draft_cost=0.0, accepted=9, rejected=1)
    assert 0 < expensive.next_k() < cheap.next_k(), "a costly drafter should draft less at the same α"
    measured = sp.AdaptiveK(k_max=4, verify_costs=(1.0, 3.0, 3.1, 3.2, 3.3), accepted=1, rejected=9)
    assert measured.next_k() == 0, "α = 0.1 cannot pay for a verify step that costs 3 decode steps"
    with pytest.raises(ValueError, match="verify_costs"):
        sp.AdaptiveK(k_max=4, verify_costs=(1.0, 2.0))
    with pytest.raises(ValueError, match="k_max"):
        sp.AdaptiveK(k_max=0)


# --- stopping inside an accepted run ---------------------------------------------------------------------------

def test_stops_on_eos_inside_an_accepted_run(tiny):
    ids = prompts()[2]
    plain = kc.generate(tiny, ids, 20, GREEDY)
    model = replace(tiny, config=replace(tiny.config, eos_token_ids=(plain[6],)))
    expected = kc.generate(model, ids, 20, GREEDY)
    # the target drafting for itself accepts all 8: the EOS sits in the middle of an accepted run
    out = sp.generate(model, ids, 20, GREEDY, drafter=ModelDrafter(model, target=model), k=8)
    assert out == expected and out[-1] == plain[6] and len(out) <= 7


@pytest.mark.parametrize("max_new", [1, 2, 5, 9])
def test_stops_at_max_tokens_exactly(tiny, max_new):
    ids = prompts()[2]
    out = sp.generate(tiny, ids, max_new, GREEDY, drafter=ModelDrafter(tiny, target=tiny), k=8)
    assert out == kc.generate(tiny, ids, max_new, GREEDY) and len(out) == max_new


def test_stops_at_the_context_window(tiny):
    small = replace(tiny, config=replace(tiny.config, max_seq_len=50))
    ids = list(range(3, 43))                                  # 40 tokens: 10 positions left
    out = sp.generate(small, ids, 30, GREEDY, drafter=ModelDrafter(small, target=small), k=8)
    assert out == kc.generate(small, ids, 30, GREEDY) and len(out) == 10
    full = list(range(3, 53))                                 # the prompt fills the window: one token, no draft
    assert sp.generate(small, full, 5, GREEDY, k=4) == kc.generate(small, full, 5, GREEDY)


def test_bad_arguments_raise_clear_errors(tiny):
    with pytest.raises(ValueError, match="k"):
        sp.generate(tiny, [5, 6], 4, GREEDY, k=0)
    with pytest.raises(ValueError, match="empty"):
        sp.generate(tiny, [], 4, GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        ModelDrafter(ts.tiny_model(seed=1, vocab_size=128), target=tiny)
    with pytest.raises(ValueError, match="unknown drafter"):
        make_drafter("telepathy", tiny)
    with pytest.raises(ValueError, match="draft model"):
        make_drafter("int8", tiny)
    with pytest.raises(ValueError, match="layer count"):
        early_exit_model(tiny, 3)
    logits = np.zeros((3, 8), np.float32)
    with pytest.raises(ValueError, match="k \\+ 1"):
        sp.verify_greedy(logits, [1], GREEDY)
    with pytest.raises(ValueError, match="draft_probs"):
        sp.verify_stochastic(logits, [1, 2], np.ones((2, 7)) / 7, SamplingParams(), np.random.default_rng(0))
    with pytest.raises(ValueError, match="greedy"):
        sp.verify_greedy(logits, [1, 2], SamplingParams(temperature=1.0))


# --- verification, row by row ------------------------------------------------------------------------------------

def one_hot_logits(tokens, V=8, margin=5.0):
    """[len(tokens), V] logits whose argmax at row i is tokens[i]."""
    out = np.zeros((len(tokens), V), np.float32)
    out[np.arange(len(tokens)), tokens] = margin
    return out


def test_verify_greedy_accepts_the_agreeing_prefix_then_corrects():
    target = [3, 1, 4, 1, 5]                                     # the target's choice after each draft prefix
    logits = one_hot_logits(target)
    assert sp.verify_greedy(logits, [3, 1, 4, 1], GREEDY) == [3, 1, 4, 1, 5]   # all accepted + bonus
    assert sp.verify_greedy(logits, [3, 1, 7, 1], GREEDY) == [3, 1, 4]         # third wrong: corrected, stop
    assert sp.verify_greedy(logits, [0, 1, 4, 1], GREEDY) == [3]               # first wrong
    assert sp.verify_greedy(logits[:1], [], GREEDY) == [3]                      # no draft: a plain decode


def test_verify_greedy_applies_the_repetition_penalty_to_the_draft_prefix():
    # row 1 prefers token 2 (logit 2.0) over 5 (1.5) until 2 has been seen: the draft put it in the context
    logits = np.zeros((2, 8), np.float32)
    logits[0, 2] = 3.0
    logits[1, 2], logits[1, 5] = 2.0, 1.5
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sp.verify_greedy(logits, [2], params, seen=[7]) == [2, 5]
    assert sp.verify_greedy(logits, [2], GREEDY, seen=[7]) == [2, 2]


def chi2_bound(freq, probs, n, min_expected=5.0):
    """Pearson's chi-square of observed frequencies against probs (categories expected fewer than min_expected
    times pooled into one), and the bound a correct sampler stays under: mean + 6 standard deviations (+10) of
    chi-square with that many degrees of freedom (no scipy; as test_sampling). Returns (chi2, bound)."""
    freq, probs = np.ravel(freq), np.ravel(probs)
    big = probs * n >= min_expected
    f = np.append(freq[big], freq[~big].sum())
    p = np.append(probs[big], probs[~big].sum())
    keep = p > 0
    assert (f[~keep] == 0).all(), "drew a token of probability zero"
    dof = keep.sum() - 1
    return n * np.sum((f[keep] - p[keep]) ** 2 / p[keep]), dof + 6 * math.sqrt(2 * dof) + 10


@pytest.mark.parametrize("deterministic", [False, True])
def test_verify_stochastic_first_token_has_the_target_distribution(deterministic):
    # synthetic rows: the first output token must be distributed as p_0 whatever the draft's q
    rng = np.random.default_rng(0)
    V, n = 6, 6000
    logits = rng.standard_normal((2, V)).astype(np.float32) * 1.5        # [k+1, V], k = 1
    params = SamplingParams(temperature=1.0)
    p0 = probabilities(logits[0], params)
    q = np.array([0.05, 0.05, 0.05, 0.05, 0.1, 0.7])                      # a bad drafter: loves token 5
    first = []
    for seed in range(n):
        r = np.random.default_rng(seed)
        if deterministic:                                                  # always proposes 5, q one-hot
            out = sp.verify_stochastic(logits, [5], None, params, r)
        else:
            x = draw(q, r)
            out = sp.verify_stochastic(logits, [x], q[None, :], params, r)
        first.append(out[0])
    chi2, bound = chi2_bound(np.bincount(first, minlength=V) / n, p0, n)
    assert chi2 < bound, f"chi2 {chi2:.1f} >= {bound:.1f}: the first token is not distributed as the target's"


# The two classic mistakes, written out so the test below can show it catches them.
def accept_all(logits, draft, draft_probs, params, rng, seen=()):
    """Wrong: trust the drafter (every draft token accepted, then the bonus)."""
    ctx = list(seen) + list(draft)
    return list(draft) + [draw(probabilities(logits[len(draft)], params, ctx), rng)]


def skip_residual(logits, draft, draft_probs, params, rng, seen=()):
    """Wrong: the right acceptance test, but a rejection resamples from p instead of the residual max(0, p - q)."""
    out, ctx = [], list(seen)
    for i, x in enumerate(draft):
        p = probabilities(logits[i], params, ctx)
        q = draft_probs[i] if draft_probs is not None else np.eye(logits.shape[1])[x]
        if rng.random() * q[x] < p[x]:
            out.append(int(x))
            ctx.append(int(x))
            continue
        return out + [draw(p, rng)]
    return out + [draw(probabilities(logits[len(draft)], params, ctx), rng)]


STAT_V = 16
STAT_PROMPT = [5, 3, 7]
# temperature, top-k and the repetition penalty all shape p: verification must use exactly sampling's p
STAT_PARAMS = dict(temperature=2.5, top_k=10, repetition_penalty=1.3, ignore_eos=True)


@pytest.fixture(scope="module")
def stat_setup():
    """A tiny target with 16 tokens, a different random model as the (bad) drafter, and the exact joint
    distribution of the first two generated tokens, computed by enumeration with sampling's own probabilities."""
    target = ts.tiny_model(seed=0, vocab_size=STAT_V)
    bad = ts.tiny_model(seed=1, vocab_size=STAT_V)
    params = SamplingParams(**STAT_PARAMS)

    def p_next(seq):
        return probabilities(naive.forward(target, seq)[-1], params, seen=seq)   # [V]
    p1 = p_next(STAT_PROMPT)
    joint = np.stack([p1[a] * p_next(STAT_PROMPT + [a]) for a in range(STAT_V)])  # [V, V]
    return target, bad, joint


def first_two_frequencies(target, bad, n):
    counts = np.zeros((STAT_V, STAT_V))
    for seed in range(n):
        params = SamplingParams(**STAT_PARAMS, seed=seed)
        # 3 new tokens with k = 2: token 1 comes from the prompt's logits, token 2 from the first verify step
        out = sp.generate(target, STAT_PROMPT, 3, params, drafter=ModelDrafter(bad, target=target), k=2)
        counts[out[0], out[1]] += 1
    return counts / n


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["residual", "accept_all", "skip_residual"])
def test_stochastic_verification_preserves_the_target_distribution(stat_setup, monkeypatch, rule):
    target, bad, joint = stat_setup
    n = 1500
    if rule != "residual":
        monkeypatch.setattr(sp, "verify_stochastic", {"accept_all": accept_all, "skip_residual": skip_residual}[rule])
    chi2, bound = chi2_bound(first_two_frequencies(target, bad, n), joint, n)
    if rule == "residual":
        assert chi2 < bound, f"chi2 {chi2:.1f} >= {bound:.1f}: speculative sampling changed the distribution"
    else:
        # the check has teeth: each wrong rule is caught by a wide margin (it is not a coin flip at the bound)
        assert chi2 > 3 * bound, f"the {rule} rule went unnoticed (chi2 {chi2:.1f}, bound {bound:.1f})"


def test_seeded_stochastic_speculation_is_reproducible(tiny):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    ids = prompts()[2]
    runs = [sp.generate(tiny, ids, 30, params, drafter=make_drafter("early-exit", tiny, early_exit_layers=1), k=3)
            for _ in range(2)]
    assert runs[0] == runs[1]


# --- drafters -----------------------------------------------------------------------------------------------

def test_ngram_proposes_what_followed_the_latest_match():
    d = NgramDrafter(max_n=2, min_n=1)
    ctx = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    assert d.propose(ctx, 3).tokens == [5, 6, 7]          # "2 3" last seen at 5..6, followed by 5 6 7
    assert d.propose(ctx, 10).tokens == [5, 6, 7, 2, 3]   # runs up to the end of the context
    assert d.propose([1, 2, 3, 4], 3).tokens == []        # nothing repeats
    assert d.propose([8], 3).tokens == []
    assert NgramDrafter(max_n=3).propose([7, 1, 2, 3, 8, 2, 3, 9, 1, 2, 3], 2).tokens == [8, 2], \
        "the longest matching n-gram wins over a more recent shorter one"
    assert d.propose(ctx, 3).probs is None                # deterministic: q is one-hot
    with pytest.raises(ValueError, match="min_n"):
        NgramDrafter(max_n=1, min_n=2)


def test_early_exit_model_is_the_first_layers_with_the_targets_head(tiny):
    ee = early_exit_model(tiny, 1)
    assert ee.config.n_layers == 1 and len(ee.layers) == 1
    assert ee.layers[0] is tiny.layers[0] and ee.embed is tiny.embed and ee.final_norm is tiny.final_norm
    assert tiny.config.n_layers == 2 and len(tiny.layers) == 2, "the target is untouched"
    np.testing.assert_array_equal(early_exit_model(tiny, 2).embed, tiny.embed)


def test_model_drafter_cache_follows_the_context(tiny):
    # after any sequence of proposals and rewrites, the draft cache equals a fresh prefill of the context
    d = ModelDrafter(ts.tiny_model(seed=7), target=tiny)
    ctx = prompts()[1]
    for extra in ([9, 9], [9, 10, 11], [4], [4, 5, 6, 7, 8]):     # accepted, rejected, corrected tokens
        draft = d.propose(ctx + extra, 3, GREEDY, np.random.default_rng(0))
        assert len(draft) == 3 and d.cached == ctx + extra + draft.tokens[:2]
        fresh = kc.KVCache.allocate(d.model.config, 64)
        kc.forward_with_cache(d.model, fresh, d.cached)
        np.testing.assert_allclose(d.cache.k[:, :d.cache.length], fresh.k[:, :fresh.length], rtol=1e-5, atol=1e-5)
    assert d.cost == pytest.approx(1.0)                           # same shapes as the target


# --- rollback -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 3, 10])
def test_contiguous_rewind_then_append_equals_never_appending(tiny, n):
    ids = prompts()[2][:10]
    cache = kc.KVCache.allocate(tiny.config, 32)
    kc.forward_with_cache(tiny, cache, ids)
    kept_k, kept_v = cache.k[:, :10 - n].copy(), cache.v[:, :10 - n].copy()
    cache.rewind(n)                                           # 0: nothing, 3: a few, 10: all the way
    assert cache.length == 10 - n
    new = [17, 18, 19]
    logits = kc.forward_with_cache(tiny, cache, new, all_logits=True)
    # Exact: a cache that never held the dropped rows — the kept rows, bit for bit, in a fresh (zeroed) cache —
    # appended the same way. Same rows, same calls, so the same bits; a rewind that kept a trace of the dropped
    # positions (the length, the RoPE position, attention reading past `length`) would differ here.
    never = kc.KVCache.allocate(tiny.config, 32)
    never.k[:, :10 - n], never.v[:, :10 - n], never.length = kept_k, kept_v, 10 - n
    expected = kc.forward_with_cache(tiny, never, new, all_logits=True)
    np.testing.assert_array_equal(logits, expected)
    np.testing.assert_array_equal(cache.k[:, :cache.length], never.k[:, :never.length])
    np.testing.assert_array_equal(cache.v[:, :cache.length], never.v[:, :never.length])
    # Independently, against one forward of the whole sequence: the same math in other matmul shapes (a 10-row
    # and a 3-row GEMM vs one of 13 - n rows). A row's bits may depend on the GEMM's row count (OpenBLAS's
    # Haswell kernel: up to 4e-6 on these values; SkylakeX: not at all), so equal to float32 rounding only.
    fresh = kc.KVCache.allocate(tiny.config, 32)
    one_shot = kc.forward_with_cache(tiny, fresh, ids[:10 - n] + new, all_logits=True)[-3:]
    np.testing.assert_allclose(logits, one_shot, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(cache.k[:, :cache.length], fresh.k[:, :fresh.length], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 11, 2.0, True])
def test_contiguous_rewind_refuses_nonsense(tiny, bad):
    cache = kc.KVCache.allocate(tiny.config, 32)
    cache.length = 10
    with pytest.raises(ValueError, match="rewind"):
        kc.rewind(cache, bad)
    assert cache.length == 10


@pytest.mark.parametrize("num_tokens, n, kept_blocks", [
    (10, 0, 3),      # at 0: nothing changes
    (10, 1, 3),      # inside the last block (positions 8, 9 -> 8)
    (10, 2, 2),      # exactly empties the last block
    (10, 7, 1),      # across blocks: 3 positions left, one block
    (10, 10, 0),     # all the way
])
def test_rewind_blocks_frees_exactly_the_blocks_left_empty(num_tokens, n, kept_blocks):
    alloc = BlockAllocator(8, 4)
    table = [alloc.allocate() for _ in range(3)]
    original = list(table)
    dropped = sp.rewind_blocks(table, num_tokens, n, 4, alloc)
    assert table == original[:kept_blocks] and dropped == original[kept_blocks:]
    assert alloc.num_free == 8 - kept_blocks
    alloc.check()


def test_rewind_blocks_keeps_a_block_another_owner_holds():
    alloc = BlockAllocator(4, 4)
    table = [alloc.allocate() for _ in range(2)]
    alloc.incref(table[1])                                    # e.g. the prefix cache or another sequence
    sp.rewind_blocks(table, 8, 8, 4, alloc)
    assert table == [] and alloc.refcount[1] == 1 and alloc.num_free == 3
    alloc.check()


def test_rewind_blocks_refuses_nonsense():
    alloc = BlockAllocator(4, 4)
    table = [alloc.allocate()]
    with pytest.raises(ValueError, match="num_tokens"):
        sp.rewind_blocks(table, 5, 1, 4, alloc)               # one block cannot hold 5 positions
    with pytest.raises(ValueError, match="n must"):
        sp.rewind_blocks(table, 3, 4, 4, alloc)
    assert table == [0] and alloc.num_free == 3


# --- the real model ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_prompts(smol_tok):
    doc = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. It is named after "
           "the engineer Gustave Eiffel, whose company designed and built it.")
    return [smol_tok.encode_chat([{"role": "user", "content": doc + "\nQuote its first sentence."}]),
            smol_tok.encode_chat([{"role": "user", "content": "Write a Python function that adds two numbers."}])]


@pytest.mark.real
@pytest.mark.slow
def test_greedy_speculative_equals_kv_cache_greedy_smollm2(smol, smol_prompts):
    # early exit after 2 of 30 layers and a 4-layer truncated copy (standing in for the int8 copy): cheap drafters
    # that often disagree, so both the accept and the correct paths run
    drafters = {"ngram": lambda: NgramDrafter(),
                "early-exit": lambda: make_drafter("early-exit", smol, early_exit_layers=2),
                "draft": lambda: make_drafter("draft", smol, draft_model=early_exit_model(smol, 4))}
    for ids in smol_prompts:
        expected = kc.generate(smol, ids, 8, GREEDY)
        for kind, make in drafters.items():
            for k in KS:
                stats = sp.SpecStats()
                out = sp.generate(smol, ids, 8, GREEDY, drafter=make(), k=k, stats=stats)
                assert out == expected, f"{kind}, k={k}"
        assert stats.steps >= 1


# Chat prompts on which greedy speculation on the W4A8 default decoded other tokens than plain decoding when the
# prompt's last token opened the first verify step (in the fused step's kernels, where plain decoding runs it in the
# prefill's): 5 of these 12 on a Zen 5's avx512vnni kernels, 3 with avx2 forced, other ones on each.
CHAT_QUESTIONS = ["What is the capital of France?", "Write a haiku about caches.",
                  "Explain in three sentences why the sky is blue.", "List three prime numbers.", "Who wrote Hamlet?",
                  "Translate 'good morning' into French.", "What is 12 times 7?", "Name a famous painting.",
                  "Describe a cat in one sentence.", "What does a CPU do?", "Give me a synonym for happy.",
                  "Summarise the plot of Cinderella in one sentence."]


@pytest.mark.real
def test_greedy_speculation_on_the_quantised_default_decodes_plain_decodings_tokens(smol, smol_tok):
    """The default fast path (quant=auto, numba) rounds activations to int8, so a ~1e-7 difference in float order can
    move a logit by ~0.5: speculation must compute every row exactly as plain decoding does. It does: the prompt is
    prefilled whole (the first token comes from its logits, as in plain decoding) and each verify of k + 1 <=
    MAX_ROWS rows runs in the fused step, whose rows equal one-row decode steps bit for bit."""
    from tinyserve import backend, quant
    mode = backend.default_quant()
    model = backend.set_backend(quant.quantize_model(smol, mode), mode, "numba")
    differs = []
    for q in CHAT_QUESTIONS:
        ids = smol_tok.encode_chat([{"role": "user", "content": q}])
        plain = kc.generate(model, ids, 32, GREEDY)
        for k in (3, 7):
            if sp.generate(model, ids, 32, GREEDY, drafter=NgramDrafter(), k=k) != plain:
                differs.append((q, k))
    assert not differs, f"{mode}: greedy speculation decoded other tokens than plain decoding for {differs}"
