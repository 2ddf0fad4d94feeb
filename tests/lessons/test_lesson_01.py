"""Lesson 1 self-checks: RMSNorm, RoPE, softmax, causal attention with a K/V repeat, top-p filtering.

`pytest` runs them on the reference (tinyserve.layers / tinyserve.sampling); `make check-1` runs them on
lessons/01_naive_sampling/exercises.py. Expected values come from formulas and slow loops written here, from
small cases worked out by hand, and from properties the piece must have, never from the code under test.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import layers, naive
from tinyserve.model import Model
from tests.lessons.impl import load_impl

REFERENCE = {
    "rms_norm": "tinyserve.layers:rms_norm",
    "apply_rope": "tinyserve.layers:apply_rope",
    "softmax": "tinyserve.layers:softmax",
    "causal_attention": "tinyserve.layers:causal_attention",
    "top_p_filter": "tinyserve.sampling:top_p_filter",
}
impl = load_impl(1, REFERENCE)


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _randn(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _rope_angles(positions, head_dim: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, H/2] of position * theta^(-2i/H), written out here so the RoPE checks do not trust layers.py."""
    freq = theta ** (-np.arange(0, head_dim, 2) / head_dim)                 # [H/2]
    angles = np.asarray(positions, dtype=np.float64)[:, None] * freq[None]  # [T, H/2]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _forward_from_pieces(model: Model, tokens: np.ndarray, rms_norm=layers.rms_norm,
                         apply_rope=layers.apply_rope) -> np.ndarray:
    """tinyserve.model.forward written out again with swappable pieces: [T] -> logits [T, V]."""
    cfg = model.config
    T, N, K, H = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    x = model.embed[tokens]
    for w in model.layers:
        h = rms_norm(x, w.attn_norm, cfg.norm_eps)
        q = apply_rope((h @ w.wq).reshape(T, N, H), cos, sin)
        k = apply_rope((h @ w.wk).reshape(T, K, H), cos, sin)
        v = (h @ w.wv).reshape(T, K, H)
        x = x + layers.causal_attention(q, k, v).reshape(T, N * H) @ w.wo
        x = x + layers.swiglu_mlp(rms_norm(x, w.mlp_norm, cfg.norm_eps), w.w_gate, w.w_up, w.w_down)
    return rms_norm(x, model.final_norm, cfg.norm_eps) @ model.embed.T


TINY_TOKENS = np.array([1, 17, 200, 33, 33, 5, 90, 255, 0, 128, 64, 7], dtype=np.int64)


# --- rms_norm -----------------------------------------------------------------------------------------------

@pytest.mark.exercise("rms_norm")
def test_rms_norm_matches_the_formula():
    rng = _rng(1)
    x, w = _randn(rng, 5, 16), _randn(rng, 16)
    expected = x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=-1, keepdims=True) + 1e-5) * w
    out = impl.rms_norm(x, w, 1e-5)
    assert out.shape == (5, 16)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6,
        err_msg='rms_norm(x) should be x / sqrt(mean(x**2 over the last axis) + eps) * weight')


@pytest.mark.exercise("rms_norm")
def test_rms_norm_hand_computed():
    # row [3, 4]: mean square (9 + 16) / 2 = 12.5, rms = 3.5355...; weight [1, 2]
    out = impl.rms_norm(np.array([[3.0, 4.0]], np.float32), np.array([1.0, 2.0], np.float32), 0.0)
    np.testing.assert_allclose(out, [[3 / math.sqrt(12.5), 2 * 4 / math.sqrt(12.5)]], rtol=1e-6,
        err_msg='row [3, 4], weight [1, 2]: rms = sqrt(12.5), so [3/3.536, 2*4/3.536]')


@pytest.mark.exercise("rms_norm")
def test_rms_norm_normalises_each_row_without_centring_it():
    rng = _rng(2)
    x = _randn(rng, 4, 32) * np.array([[0.01], [1.0], [30.0], [1000.0]], np.float32)  # rows of very different scale
    out = impl.rms_norm(x, np.ones(32, np.float32), 1e-12)
    np.testing.assert_allclose(np.sqrt(np.mean(out.astype(np.float64) ** 2, axis=-1)), 1.0, rtol=1e-5,
        err_msg='every row should come out with root-mean-square 1 (whatever its scale going in)')
    # a constant row is not centred to zero (that would be LayerNorm): [2, 2, 2] -> [1, 1, 1]
    np.testing.assert_allclose(impl.rms_norm(np.full((1, 3), 2.0, np.float32), np.ones(3, np.float32), 0.0),
                               [[1.0, 1.0, 1.0]], rtol=1e-6,
        err_msg='a constant row [2, 2, 2] becomes [1, 1, 1]: RMSNorm divides, it does not subtract the mean')


@pytest.mark.exercise("rms_norm")
def test_rms_norm_eps_goes_inside_the_square_root():
    x = np.array([[1e-3, 1e-3], [0.0, 0.0]], np.float32)
    out = impl.rms_norm(x, np.ones(2, np.float32), 1e-6)
    # mean square 1e-6, plus eps 1e-6: 1e-3 / sqrt(2e-6) = 0.7071 (eps outside the sqrt would give ~0.999)
    np.testing.assert_allclose(out[0], 1e-3 / math.sqrt(2e-6), rtol=1e-4,
        err_msg='eps goes inside the square root: 1e-3 / sqrt(1e-6 + 1e-6) = 0.7071')
    np.testing.assert_array_equal(out[1], [0.0, 0.0],
        err_msg='an all-zero row must stay zero (eps keeps the division finite)')  # an all-zero row stays finite thanks to eps
    assert out.dtype == np.float32, f"rms_norm should keep float32, returned {out.dtype}"


@pytest.mark.exercise("rms_norm")
def test_rms_norm_in_the_full_forward(tiny):
    np.testing.assert_allclose(_forward_from_pieces(tiny, TINY_TOKENS, rms_norm=impl.rms_norm),
                               naive.forward(tiny, TINY_TOKENS), rtol=1e-4, atol=1e-4,
        err_msg="the model's logits change when your rms_norm replaces the reference one")


# --- apply_rope ---------------------------------------------------------------------------------------------

@pytest.mark.exercise("apply_rope")
def test_rope_matches_the_rotate_half_formula():
    rng = _rng(3)
    T, heads, H = 5, 3, 8
    x = _randn(rng, T, heads, H)
    cos, sin = _rope_angles([0, 1, 2, 10, 100], H)
    expected = np.empty_like(x)
    half = H // 2
    for t in range(T):
        for i in range(half):  # dimension i turns together with dimension i + H/2, by angle[t, i]
            a, b = x[t, :, i], x[t, :, i + half]
            expected[t, :, i] = a * cos[t, i] - b * sin[t, i]
            expected[t, :, i + half] = b * cos[t, i] + a * sin[t, i]
    out = impl.apply_rope(x, cos, sin)
    assert out.shape == (T, heads, H)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6,
        err_msg='apply_rope should follow the rotate-half formula in its docstring (dimension i turns with i + H/2)')


@pytest.mark.exercise("apply_rope")
def test_rope_pairs_dimension_i_with_i_plus_half_hand_computed():
    c, s = np.cos([0.5, 0.25]), np.sin([0.5, 0.25])
    cos, sin = np.array([c], np.float32), np.array([s], np.float32)
    e = np.eye(4, dtype=np.float32)[:, None, None, :]   # unit vectors, each as [T=1, heads=1, H=4]
    # e0 turns towards e2 (rotate half), not towards e1 (the neighbour pairing of llama.cpp's layout)
    np.testing.assert_allclose(impl.apply_rope(e[0], cos, sin)[0, 0], [c[0], 0, s[0], 0], atol=1e-6,
        err_msg='unit vector e0 should turn towards e2 (dimension i pairs with i + H/2), by +angle')
    np.testing.assert_allclose(impl.apply_rope(e[1], cos, sin)[0, 0], [0, c[1], 0, s[1]], atol=1e-6,
        err_msg='unit vector e1 should turn towards e3')
    np.testing.assert_allclose(impl.apply_rope(e[2], cos, sin)[0, 0], [-s[0], 0, c[0], 0], atol=1e-6,
        err_msg='unit vector e2 should turn towards -e0')


@pytest.mark.exercise("apply_rope")
def test_rope_position_zero_is_identity_and_norms_are_preserved():
    rng = _rng(4)
    x = _randn(rng, 6, 2, 16)
    cos, sin = _rope_angles(np.arange(6) * 37, 16)
    out = impl.apply_rope(x, cos, sin)
    np.testing.assert_allclose(out[0], x[0], rtol=1e-6,
        err_msg='position 0 has angle 0: apply_rope must leave it unchanged')          # angle 0: nothing turns
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5,
        err_msg="a rotation keeps every head vector's length")  # a rotation
    assert not np.allclose(out[1:], x[1:]), "positions > 0 must be rotated"


@pytest.mark.exercise("apply_rope")
def test_rope_scores_depend_only_on_the_relative_position():
    # the reason RoPE exists: q(m) . k(n) is a function of m - n, so attention sees distances, not places
    rng = _rng(5)
    H = 32
    q, k = _randn(rng, 1, 1, H), _randn(rng, 1, 1, H)

    def score(m: int, n: int) -> float:
        qm = impl.apply_rope(q, *_rope_angles([m], H))
        kn = impl.apply_rope(k, *_rope_angles([n], H))
        return float(qm.ravel() @ kn.ravel())

    for offset in (0, 3, 40):
        scores = [score(n + offset, n) for n in (0, 7, 250)]
        np.testing.assert_allclose(scores, scores[0], rtol=1e-3, atol=1e-3,
        err_msg='q(m).k(n) should depend only on the distance m - n')
    assert abs(score(3, 0) - score(0, 0)) > 1e-3, "different distances should give different scores"


@pytest.mark.exercise("apply_rope")
def test_rope_in_the_full_forward(tiny):
    np.testing.assert_allclose(_forward_from_pieces(tiny, TINY_TOKENS, apply_rope=impl.apply_rope),
                               naive.forward(tiny, TINY_TOKENS), rtol=1e-4, atol=1e-4,
        err_msg="the model's logits change when your apply_rope replaces the reference one")


# --- softmax ------------------------------------------------------------------------------------------------

@pytest.mark.exercise("softmax")
def test_softmax_hand_computed():
    # e^0 : e^ln3 = 1 : 3
    np.testing.assert_allclose(impl.softmax(np.array([0.0, math.log(3.0)])), [0.25, 0.75], rtol=1e-6,
        err_msg='softmax([0, ln 3]) = [1/4, 3/4]')


@pytest.mark.exercise("softmax")
def test_softmax_matches_the_formula_along_either_axis():
    x = _randn(_rng(6), 3, 5)
    e = np.exp(x.astype(np.float64))
    np.testing.assert_allclose(impl.softmax(x), e / e.sum(axis=-1, keepdims=True), rtol=1e-5,
        err_msg='softmax along the last axis should be exp(x) / sum(exp(x)) per row')
    np.testing.assert_allclose(impl.softmax(x, axis=0), e / e.sum(axis=0, keepdims=True), rtol=1e-5,
        err_msg='softmax(x, axis=0) should normalise each column: use the `axis` argument')
    np.testing.assert_allclose(impl.softmax(x, axis=-1).sum(axis=-1), 1.0, rtol=1e-6,
        err_msg='each row of softmax(x) should sum to 1')


@pytest.mark.exercise("softmax")
def test_softmax_of_large_logits_does_not_overflow():
    out = impl.softmax(np.array([[1000.0, 1000.0, 999.0]], np.float32))
    assert np.all(np.isfinite(out)), f"exp(1000) overflows: subtract the row max first (got {out})"
    e = np.exp([1.0, 1.0, 0.0])
    np.testing.assert_allclose(out[0], e / e.sum(), rtol=1e-5,
        err_msg='softmax([1000, 1000, 999]) should equal softmax([1, 1, 0])')


@pytest.mark.exercise("softmax")
def test_softmax_rows_of_very_different_scale():
    # each row is shifted by ITS OWN max: one max for the whole array would push the first row's exp to 0 (0/0)
    out = impl.softmax(np.array([[0.0, 1.0], [1000.0, 1001.0]], np.float32))
    assert np.all(np.isfinite(out)), (f"got {out.tolist()}: subtract the max of each row (along `axis`, "
                                      f"keepdims=True), not the max of the whole array")
    e = np.exp([0.0, 1.0])
    np.testing.assert_allclose(out, [e / e.sum()] * 2, rtol=1e-5, err_msg="softmax([0, 1]) = [0.269, 0.731] per row")


@pytest.mark.exercise("softmax")
def test_softmax_gives_masked_entries_zero_probability():
    out = impl.softmax(np.array([[0.0, -np.inf, 0.0], [5.0, -np.inf, -np.inf]], np.float32))
    np.testing.assert_allclose(out, [[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]], atol=1e-7,
        err_msg='-inf entries get probability 0; the rest share the mass')


# --- causal_attention ---------------------------------------------------------------------------------------

def _slow_causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """One (token, query head) at a time, in float64: the definition, with no repeat and no mask matrix."""
    T, N, H = q.shape
    g = N // k.shape[1]
    out = np.zeros((T, N, H))
    for t in range(T):
        for n in range(N):
            kv = n // g                                          # query heads n*g .. share kv head n // g
            s = k[: t + 1, kv].astype(np.float64) @ q[t, n] / math.sqrt(H)   # keys 0..t only
            w = np.exp(s - s.max())
            out[t, n] = (w / w.sum()) @ v[: t + 1, kv]
    return out


@pytest.mark.exercise("causal_attention")
@pytest.mark.parametrize("N,K", [(4, 2), (4, 4), (6, 1)], ids=["gqa", "mha", "mqa"])
def test_attention_matches_a_slow_loop(N, K):
    rng = _rng(7)
    T, H = 9, 8
    q, k, v = _randn(rng, T, N, H), _randn(rng, T, K, H), _randn(rng, T, K, H)
    out = impl.causal_attention(q, k, v)
    assert out.shape == (T, N, H)
    np.testing.assert_allclose(out, _slow_causal_attention(q, k, v), rtol=1e-4, atol=1e-5,
        err_msg='attention differs from a slow loop over (token, head): scale 1/sqrt(H), mask keys after the query, head n reads kv head n // g')


@pytest.mark.exercise("causal_attention")
def test_attention_hand_computed():
    # H = 4, so scores are scaled by 1/2. Token 1: q1.k0 = 0, q1.k1 = 2 ln 3 -> scaled [0, ln 3] -> weights [1/4, 3/4]
    q = np.array([[1, 1, 1, 1], [2 * math.log(3), 0, 0, 0]], np.float32)[:, None, :]
    k = np.array([[0, 1, 0, 0], [1, 0, 0, 0]], np.float32)[:, None, :]
    v = np.array([[4, 0, 0, 0], [0, 4, 0, 0]], np.float32)[:, None, :]
    out = impl.causal_attention(q, k, v)[:, 0]
    np.testing.assert_allclose(out, [[4, 0, 0, 0], [1, 3, 0, 0]], atol=1e-5,
        err_msg='hand-computed: token 0 sees only itself ([4, 0, 0, 0]); token 1 weighs keys 1/4 : 3/4')  # token 0 sees only itself


@pytest.mark.exercise("causal_attention")
def test_attention_future_tokens_do_not_change_earlier_outputs():
    rng = _rng(8)
    T, N, K, H = 7, 4, 2, 8
    q, k, v = _randn(rng, T, N, H), _randn(rng, T, K, H), _randn(rng, T, K, H)
    before = impl.causal_attention(q, k, v)
    q2, k2, v2 = q.copy(), k.copy(), v.copy()
    q2[-1], k2[-1], v2[-1] = 10.0, -10.0, 100.0  # rewrite the last token completely
    after = impl.causal_attention(q2, k2, v2)
    np.testing.assert_allclose(after[:-1], before[:-1], rtol=1e-5, atol=1e-6,
        err_msg="changing the last token must not change any earlier token's output (causal mask)")
    assert not np.allclose(after[-1], before[-1])


@pytest.mark.exercise("causal_attention")
def test_attention_query_head_n_uses_kv_head_n_div_g():
    # K = 2 kv heads for N = 4 query heads (g = 2): heads 0, 1 read kv head 0 and heads 2, 3 read kv head 1
    rng = _rng(9)
    T, H = 5, 8
    v = np.zeros((T, 2, H), np.float32)
    v[:, 0], v[:, 1] = 1.0, 2.0  # whatever the weights, the output is the constant of the kv head read
    out = impl.causal_attention(_randn(rng, T, 4, H), _randn(rng, T, 2, H), v)
    np.testing.assert_allclose(out[:, :2], 1.0, rtol=1e-5,
        err_msg='query heads 0 and 1 should read kv head 0 (n // g with g = 2)')
    np.testing.assert_allclose(out[:, 2:], 2.0, rtol=1e-5,
        err_msg='query heads 2 and 3 should read kv head 1 (n // g with g = 2)')


@pytest.mark.exercise("causal_attention")
def test_attention_in_the_full_forward(tiny):
    # the model's forward takes attention as a function: plug yours in and compare with the reference path
    positions = np.arange(len(TINY_TOKENS))
    logits = ts.forward(tiny, TINY_TOKENS, positions, attention=lambda i, q, k, v: impl.causal_attention(q, k, v))
    np.testing.assert_allclose(logits, naive.forward(tiny, TINY_TOKENS), rtol=1e-4, atol=1e-4,
        err_msg="the model's logits change when your causal_attention replaces the reference one")


@pytest.mark.real
@pytest.mark.exercise("causal_attention")
def test_attention_in_the_real_model(smol, smol_tok):
    ids = np.array(smol_tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}]))
    last = np.array([len(ids) - 1])
    logits = ts.forward(smol, ids, np.arange(len(ids)), attention=lambda i, q, k, v: impl.causal_attention(q, k, v),
                        logit_rows=last)[0]
    expected = naive.next_token_logits(smol, ids)
    np.testing.assert_allclose(logits, expected, rtol=1e-3, atol=1e-3,
        err_msg='on the real model your attention changes the logits of the next token')
    assert int(np.argmax(logits)) == int(np.argmax(expected))


# --- top_p_filter -------------------------------------------------------------------------------------------

@pytest.mark.exercise("top_p_filter")
def test_top_p_keeps_the_token_that_crosses_the_threshold():
    # 0.95 alone already exceeds p = 0.9: keep it (a filter that stops *before* the crossing keeps nothing)
    np.testing.assert_allclose(impl.top_p_filter(np.array([0.95, 0.05]), 0.9), [1.0, 0.0],
        err_msg='[0.95, 0.05] with p = 0.9: the first token crosses p and is kept (alone, renormalised to 1)')
    # 0.5 < 0.6, so the second token (which crosses 0.6) is kept too; the third is not needed
    np.testing.assert_allclose(impl.top_p_filter(np.array([0.5, 0.25, 0.125, 0.125]), 0.6), [2 / 3, 1 / 3, 0, 0],
        err_msg='[0.5, 0.25, ...] with p = 0.6: 0.5 < 0.6, so the token that crosses 0.6 is kept too')


@pytest.mark.exercise("top_p_filter")
def test_top_p_exact_boundary_and_renormalisation():
    probs = np.array([0.5, 0.25, 0.125, 0.125])  # exact binary fractions: no rounding at the boundary
    # the first two reach p = 0.75 exactly: that is enough, the third is dropped
    np.testing.assert_allclose(impl.top_p_filter(probs, 0.75), [2 / 3, 1 / 3, 0, 0],
        err_msg='[0.5, 0.25, 0.125, 0.125] with p = 0.75: the first two reach 0.75 exactly, that is enough')
    # just above 0.75 the third token is needed; the kept ones are renormalised by 0.875
    np.testing.assert_allclose(impl.top_p_filter(probs, 0.76), [0.5 / 0.875, 0.25 / 0.875, 0.125 / 0.875, 0],
        err_msg='with p = 0.76 the third token is needed; the kept ones are divided by their sum 0.875')
    np.testing.assert_allclose(impl.top_p_filter(probs, 1.0), probs,
        err_msg='p = 1 keeps every token')  # p = 1 keeps everything


@pytest.mark.exercise("top_p_filter")
def test_top_p_keeps_token_ids_in_place_and_leaves_the_input_alone():
    probs = np.array([0.125, 0.5, 0.125, 0.25])  # sorted order is 1, 3, then 0 and 2
    copy = probs.copy()
    np.testing.assert_allclose(impl.top_p_filter(probs, 0.7), [0, 2 / 3, 0, 1 / 3],
        err_msg='kept probabilities must stay at their token ids (scatter them back after sorting)')
    np.testing.assert_array_equal(probs, copy, err_msg='top_p_filter must not modify its input array')
    # ties: four equal tokens and p = 0.5 keep exactly two of them
    assert np.count_nonzero(impl.top_p_filter(np.full(4, 0.25), 0.5)) == 2


@pytest.mark.exercise("top_p_filter")
def test_top_p_keeps_the_smallest_most_likely_set():
    rng = _rng(10)
    for _ in range(50):
        probs = rng.dirichlet(np.full(30, 0.3))
        p = float(rng.uniform(0.05, 0.99))
        out = impl.top_p_filter(probs, p)
        kept = out > 0
        mass = probs[kept].sum()
        assert mass >= p - 1e-12, "the kept tokens must reach p"
        assert mass - probs[kept].min() < p, "dropping the least likely kept token must fall below p (smallest set)"
        assert probs[kept].min() >= probs[~kept].max(initial=0.0), "keep the most likely tokens"
        np.testing.assert_allclose(out.sum(), 1.0, err_msg='the kept probabilities must sum to 1')
        np.testing.assert_allclose(out[kept], probs[kept] / mass,
        err_msg='kept tokens must keep their ratios: probs / kept mass')  # renormalised, ratios unchanged


@pytest.mark.exercise("top_p_filter")
def test_top_p_of_one_keeps_even_a_token_the_running_sum_rounds_away():
    # 0.75 + 0.25 is exactly 1.0, so the running sum before the third token is already 1.0 in float64: a sort-and-cut
    # with "mass before < p" drops it even at p = 1. p >= 1 means "off": every token keeps its probability as given.
    probs = np.array([0.75, 0.25, 1e-20])
    np.testing.assert_array_equal(impl.top_p_filter(probs, 1.0), probs,
        err_msg='p = 1 means top-p is off: return every probability unchanged (a token of 1e-20 after a running sum '
                'that has rounded to 1.0 must not be cut; check p >= 1 before sorting)')
