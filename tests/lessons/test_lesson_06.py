"""Lesson 6 self-checks: greedy verification, stochastic verification (residual resampling), paged rewind.

`make check-6` runs these against lessons/06_speculative/exercises.py; `make test` runs them against tinyserve.
The end-to-end checks plug the implementation under test into tinyserve.speculative's generate loop.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from tests.lessons.impl import load_impl
from tinyserve import kv_cache as kc
from tinyserve import speculative as sp
from tinyserve.drafters import ModelDrafter, NgramDrafter, draw, make_drafter
from tinyserve.paged import BlockAllocator
from tinyserve.sampling import SamplingParams, probabilities
from tinyserve.weights import tiny_model

REFERENCE = {
    "verify_greedy": "tinyserve.speculative:verify_greedy",
    "verify_stochastic": "tinyserve.speculative:verify_stochastic",
    "rewind_blocks": "tinyserve.speculative:rewind_blocks",
}
impl = load_impl(6, REFERENCE)
GREEDY = SamplingParams(temperature=0)


def peaked(tokens, V=8):
    """[len(tokens), V] logits whose argmax at row i is tokens[i]."""
    out = np.zeros((len(tokens), V), np.float32)
    out[np.arange(len(tokens)), tokens] = 5.0
    return out


# --- verify_greedy ---------------------------------------------------------------------------------------------

@pytest.mark.exercise("verify_greedy")
def test_greedy_accepts_the_agreeing_prefix_and_corrects_the_first_miss():
    logits = peaked([3, 1, 4, 1, 5])             # the target's choice after each draft prefix
    assert impl.verify_greedy(logits, [3, 1, 4, 1], GREEDY) == [3, 1, 4, 1, 5], "all 4 agree: plus the bonus token"
    assert impl.verify_greedy(logits, [3, 1, 7, 1], GREEDY) == [3, 1, 4], "the 3rd is wrong: replaced, then stop"
    assert impl.verify_greedy(logits, [0, 1, 4, 1], GREEDY) == [3], "the 1st is wrong: only the correction"
    assert impl.verify_greedy(logits[:1], [], GREEDY) == [3], "no draft: one plain decode step"


@pytest.mark.exercise("verify_greedy")
def test_greedy_sees_the_accepted_tokens_through_the_repetition_penalty():
    logits = np.zeros((2, 8), np.float32)
    logits[0, 2] = 3.0
    logits[1, 2], logits[1, 5] = 2.0, 1.5        # row 1 prefers 2, unless 2 was just seen (penalty 2: 2.0 -> 1.0)
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert impl.verify_greedy(logits, [2], params, seen=[7]) == [2, 5]
    assert impl.verify_greedy(logits, [2], GREEDY, seen=[7]) == [2, 2]


@pytest.mark.exercise("verify_greedy")
def test_greedy_row_i_sees_exactly_the_drafts_before_it():
    # repetition penalty 2 (a seen token's positive logit is halved); seen = [7]; draft [2, 4, 6].
    # Row i is the target after seen + draft[:i]: not yet draft[i] (the token it judges), not the drafts after it.
    logits = np.zeros((4, 8), np.float32)
    logits[0, 2], logits[0, 5] = 2.0, 1.5    # row 0 sees [7]: keeps 2. Seeing its own draft token 2 -> 1.0: picks 5
    logits[1, 4], logits[1, 5] = 2.0, 1.5    # row 1 sees [7, 2]: keeps 4 (seeing 4 itself would pick 5)
    logits[2, 4], logits[2, 6] = 2.0, 1.8    # row 2 sees [7, 2, 4]: 4 -> 1.0, picks 6 = draft[2] (missing 4: picks 4)
    logits[3, 6], logits[3, 3] = 2.0, 1.5    # bonus row sees [7, 2, 4, 6]: 6 -> 1.0, picks 3
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    got = impl.verify_greedy(logits, [2, 4, 6], params, seen=[7])
    assert got == [2, 4, 6, 3], (
        f"got {got}, expected [2, 4, 6, 3]: row i's penalty sees seen + draft[:i], the tokens before it. Including "
        f"draft[i] itself (off by one) makes row 0 reject 2; missing the one just accepted makes row 2 pick 4; the "
        f"bonus row must see all k accepted drafts")


@pytest.mark.exercise("verify_greedy")
def test_greedy_refuses_the_wrong_number_of_rows():
    with pytest.raises(ValueError):
        impl.verify_greedy(np.zeros((2, 8), np.float32), [1, 2], GREEDY)


@pytest.mark.exercise("verify_greedy")
def test_greedy_speculation_is_token_identical_to_plain_decoding(tiny, monkeypatch):
    monkeypatch.setattr(sp, "verify_greedy", impl.verify_greedy)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, 12).tolist()
    expected = kc.generate(tiny, ids * 3, 30, GREEDY)
    for drafter in (NgramDrafter(), make_drafter("draft", tiny, draft_model=tiny_model(seed=7)),
                    ModelDrafter(tiny, target=tiny)):
        for k in (1, 4):
            assert sp.generate(tiny, ids * 3, 30, GREEDY, drafter=drafter, k=k) == expected, (drafter.name, k)


# --- verify_stochastic -----------------------------------------------------------------------------------------

def chi2_and_bound(freq, probs, n):
    """Pearson's chi-square (categories expected < 5 times pooled) and the bound a correct sampler stays under:
    mean + 6 standard deviations (+10) for its degrees of freedom."""
    big = probs * n >= 5
    f, p = np.append(freq[big], freq[~big].sum()), np.append(probs[big], probs[~big].sum())
    keep = p > 0
    dof = keep.sum() - 1
    return n * np.sum((f[keep] - p[keep]) ** 2 / p[keep]), dof + 6 * math.sqrt(2 * dof) + 10


def first_tokens(logits, q, n, deterministic):
    out = []
    for seed in range(n):
        rng = np.random.default_rng(seed)
        if deterministic:
            res = impl.verify_stochastic(logits, [5], None, SamplingParams(), rng)
        else:
            res = impl.verify_stochastic(logits, [draw(q, rng)], q[None, :], SamplingParams(), rng)
        out.append(res[0])
    return np.bincount(out, minlength=logits.shape[1]) / n


@pytest.mark.exercise("verify_stochastic")
@pytest.mark.parametrize("deterministic", [False, True])
def test_stochastic_first_token_follows_the_target_not_the_drafter(deterministic):
    # the drafter loves token 5; the target does not. Accept-all would give q, resampling from p instead of the
    # residual would give min(p, q) + (1 - sum min(p, q)) p: both fail this test by a wide margin.
    logits = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32) * 1.5
    q = np.array([0.05, 0.05, 0.05, 0.05, 0.1, 0.7])
    n = 4000
    chi2, bound = chi2_and_bound(first_tokens(logits, q, n, deterministic), probabilities(logits[0], SamplingParams()),
                                 n)
    assert chi2 < bound, (f"chi-square {chi2:.0f} over the bound {bound:.0f}: the first token is not distributed as "
                          f"the target's p. On a rejection, draw from max(0, p - q), not from p")


@pytest.mark.exercise("verify_stochastic")
def test_stochastic_accepts_everything_when_the_drafter_is_the_target():
    logits = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    params = SamplingParams(temperature=0.7)
    q = np.stack([probabilities(row, params) for row in logits[:3]])
    rng = np.random.default_rng(2)
    for _ in range(50):
        draft = [draw(qi, rng) for qi in q]      # (q does not depend on the prefix here: a synthetic target)
        out = impl.verify_stochastic(logits, draft, q, params, rng)
        assert out[:3] == draft and len(out) == 4, "p == q: min(1, p/q) = 1, every draft token must be accepted"


@pytest.mark.exercise("verify_stochastic")
def test_stochastic_never_returns_a_token_the_filters_removed():
    logits = np.random.default_rng(3).standard_normal((3, 10)).astype(np.float32)
    params = SamplingParams(top_k=3)
    allowed = [set(np.argsort(-row)[:3].tolist()) for row in logits]
    rng = np.random.default_rng(4)
    for _ in range(200):
        draft = rng.integers(0, 10, 2).tolist()  # a drafter that knows nothing (one-hot q)
        out = impl.verify_stochastic(logits, draft, None, params, rng)
        assert all(t in allowed[i] for i, t in enumerate(out)), \
            "every returned token must be possible under the target's top-k (accepted or resampled)"


@pytest.mark.exercise("verify_stochastic")
def test_stochastic_uses_every_sampling_option_and_the_accepted_tokens_as_context():
    # Temperature, top-k, top-p and a repetition penalty at once, with a context `seen`: p_i must be exactly what
    # sampling.probabilities gives for row i after seen + the tokens accepted so far. Token 2 is row 0's and row 1's
    # favourite, the drafter proposes it, and row 0's runner-up 4 is in `seen`: forgetting `seen`, a filter, or to append an accepted
    # token to the context each moves the first or the second token's distribution far from the target's.
    V = 7
    logits = np.array([[0.3, 1.1, 2.4, -0.6, 1.7, 0.2, -1.3],
                       [1.6, -0.4, 2.6, 0.9, 0.1, 1.2, -2.0]], np.float32)
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.93, repetition_penalty=1.7)
    seen = [6, 4]
    p0 = probabilities(logits[0], params, seen)
    p1 = probabilities(logits[1], params, seen + [2])
    n = 4000
    first, second = [], []
    for s in range(n):
        out = impl.verify_stochastic(logits, [2], None, params, np.random.default_rng(s), seen=list(seen))
        first.append(out[0])
        if out[0] == 2:
            assert len(out) == 2, "an accepted draft token is followed by the bonus token"
            second.append(out[1])
    chi2, bound = chi2_and_bound(np.bincount(first, minlength=V) / n, p0, n)
    assert chi2 < bound, (f"chi-square {chi2:.0f} over {bound:.0f}: the first token is not distributed as "
                          "sampling.probabilities(logits[0], params, seen): use the repetition penalty on `seen`, "
                          "the temperature, top-k and top-p, as sample() would")
    m = len(second)
    chi2, bound = chi2_and_bound(np.bincount(second, minlength=V) / m, p1, m)
    assert chi2 < bound, (f"chi-square {chi2:.0f} over {bound:.0f}: after the draft token 2 is accepted, the bonus "
                          "token must follow probabilities(logits[1], params, seen + [2]): the accepted token joins the "
                          "context the repetition penalty sees")


@pytest.mark.exercise("verify_stochastic")
def test_stochastic_refuses_wrong_shapes():
    with pytest.raises(ValueError):
        impl.verify_stochastic(np.zeros((2, 8), np.float32), [1, 2], None, SamplingParams(), np.random.default_rng())
    with pytest.raises(ValueError):
        impl.verify_stochastic(np.zeros((3, 8), np.float32), [1, 2], np.ones((2, 5)) / 5, SamplingParams(),
                               np.random.default_rng())


# --- rewind_blocks ---------------------------------------------------------------------------------------------

@pytest.mark.exercise("rewind_blocks")
@pytest.mark.parametrize("num_tokens, n, kept", [(10, 0, 3), (10, 1, 3), (10, 2, 2), (10, 7, 1), (10, 10, 0),
                                                 (12, 4, 2), (12, 5, 2), (12, 9, 1), (0, 0, 0)])
def test_rewind_frees_exactly_the_blocks_left_without_a_kept_position(num_tokens, n, kept):
    alloc = BlockAllocator(8, 4)
    table = [alloc.allocate() for _ in range(3)]
    original = list(table)
    dropped = impl.rewind_blocks(table, num_tokens, n, 4, alloc)
    assert table == original[:kept], f"{num_tokens - n} positions left need {kept} blocks of 4"
    assert list(dropped) == original[kept:]
    assert alloc.num_free == 8 - kept
    alloc.check()


@pytest.mark.exercise("rewind_blocks")
def test_rewind_decrefs_a_shared_block_instead_of_freeing_it():
    alloc = BlockAllocator(4, 4)
    table = [alloc.allocate(), alloc.allocate()]
    alloc.incref(table[1])                        # someone else (the prefix cache, another request) holds it too
    impl.rewind_blocks(table, 8, 5, 4, alloc)
    assert table == [0] and alloc.refcount[1] == 1 and alloc.num_free == 2
    alloc.check()


@pytest.mark.exercise("rewind_blocks")
def test_rewind_refuses_nonsense():
    alloc = BlockAllocator(4, 4)
    table = [alloc.allocate()]
    for num_tokens, n in ((5, 1), (3, 4), (3, -1), (-1, 0)):
        with pytest.raises(ValueError):   # more tokens than the table holds, n > num_tokens, negatives
            impl.rewind_blocks(table, num_tokens, n, 4, alloc)
    assert table == [0] and alloc.num_free == 3
