"""Sampling: parameter validation, greedy, the filters (top-k, top-p, min-p, repetition penalty) and the
distribution actually drawn from, checked with many seeded draws."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tinyserve.sampling import (SamplingParams, apply_repetition_penalty, min_p_filter, probabilities, sample,
                                top_k_filter, top_p_filter)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"), ({"temperature": None}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_k": True}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": -0.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"), ({"top_p": False}, "top_p"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"), ({"min_p": float("nan")}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"repetition_penalty": 1e-39}, "repetition_penalty"), ({"repetition_penalty": 1e3}, "repetition_penalty"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_new_tokens": -5}, "max_new_tokens"),
    ({"max_new_tokens": 3.0}, "max_new_tokens"), ({"max_new_tokens": True}, "max_new_tokens"),
    ({"stop": ("",)}, "stop"), ({"stop": (1,)}, "stop"), ({"stop": ("ok", None)}, "stop"),
    ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"),
])
def test_nonsense_params_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams: {field}"):
        SamplingParams(**kwargs)


def test_sensible_params_are_accepted():
    p = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                       max_new_tokens=10, stop="\n\n", seed=np.int64(3))
    assert p.stop == ("\n\n",)             # a single string means one stop string, not one per character
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1, temperature=2.0).greedy
    assert not SamplingParams().greedy
    assert SamplingParams(top_p=1.0, min_p=1.0, temperature=np.float32(0.5)).top_p == 1.0


def logits_of(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


@pytest.fixture
def random_logits():
    return np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 3


def test_greedy_is_argmax(random_logits):
    rng = np.random.default_rng(0)
    for temp_zero in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_p=0.1, min_p=0.5)):
        assert sample(random_logits, temp_zero, rng) == int(np.argmax(random_logits))
    assert isinstance(sample(random_logits, SamplingParams(temperature=0.0), rng), int)


def test_top_k_1_is_greedy_at_any_temperature(random_logits):
    for seed in range(20):
        p = SamplingParams(top_k=1, temperature=5.0, seed=seed)
        assert sample(random_logits, p, p.make_rng()) == int(np.argmax(random_logits))


def test_top_k_filter_keeps_exactly_k_on_ties():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0], dtype=np.float32)
    out = top_k_filter(logits, 2)
    kept = np.flatnonzero(np.isfinite(out))
    assert len(kept) == 2                       # not 4: three tokens tie for second place, one of them is kept
    assert 1 in kept and set(kept) - {1} <= {2, 3, 4}
    np.testing.assert_array_equal(out[kept], logits[kept])
    assert len(np.flatnonzero(np.isfinite(top_k_filter(np.zeros(10), 3)))) == 3   # all tied


def test_top_k_filter_keeps_the_k_largest(random_logits):
    out = top_k_filter(random_logits, 5)
    kept = np.flatnonzero(np.isfinite(out))
    assert set(kept) == set(np.argsort(random_logits)[-5:])
    assert top_k_filter(random_logits, 0) is random_logits     # 0 = off
    assert top_k_filter(random_logits, 5000) is random_logits  # k >= V keeps everything


PROBS = np.array([0.5, 0.25, 0.125, 0.125])   # exact in binary: boundary cases are not blurred by rounding


@pytest.mark.parametrize("p, kept", [
    # a token is kept when the mass of the tokens before it (0, 0.5, 0.75, 0.875) is still below p
    (0.5, [0]),            # token 0 alone reaches exactly 0.5: nothing more is needed
    (0.6, [0, 1]),         # token 1 crosses the threshold (0.5 -> 0.75): it is kept
    (0.75, [0, 1]),        # exactly reached by tokens 0 and 1
    (0.8, [0, 1, 2]),      # token 2 crosses (0.75 -> 0.875); token 3's mass before, 0.875, is already >= 0.8
    (0.9, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),   # 1 = off
])
def test_top_p_keeps_the_token_that_crosses(p, kept):
    out = top_p_filter(PROBS, p)
    assert list(np.flatnonzero(out)) == kept
    assert math.isclose(out.sum(), 1.0)
    np.testing.assert_allclose(out[kept], PROBS[kept] / PROBS[kept].sum())


def test_top_p_never_keeps_nothing():
    # a single very likely token with p below its probability: it must survive (a classic off-by-one)
    out = top_p_filter(np.array([0.95, 0.03, 0.02]), 0.9)
    assert list(out) == [1.0, 0.0, 0.0]
    out = top_p_filter(np.array([0.95, 0.03, 0.02]), 1e-9)
    assert list(out) == [1.0, 0.0, 0.0]


def test_min_p_scales_with_the_best_token():
    out = min_p_filter(PROBS, 0.5)          # keep p >= 0.5 * 0.5 = 0.25
    np.testing.assert_allclose(out, [2 / 3, 1 / 3, 0, 0])
    assert min_p_filter(PROBS, 0.0) is PROBS
    np.testing.assert_allclose(min_p_filter(PROBS, 1.0), [1, 0, 0, 0])


def test_repetition_penalty_sign_rule():
    logits = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1], 2.0)   # repeats count once
    # positive logits are divided, negative ones multiplied: a seen token always becomes less likely
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.5])
    np.testing.assert_array_equal(logits, [2.0, -2.0, 1.0, 0.5])   # the input is not modified
    assert apply_repetition_penalty(logits, [], 2.0) is logits
    assert apply_repetition_penalty(logits, [0], 1.0) is logits
    # the greedy pick follows it: token 0 (logit 2.0) was the argmax; penalised by 4 it drops to 0.5 < 1.0
    assert sample(logits, SamplingParams(temperature=0.0, repetition_penalty=4.0), None, seen=[0]) == 2


def test_repetition_penalty_at_its_bounds_cannot_overflow():
    # repetition_penalty=1e-39 once passed validation and turned every seen float32 logit into inf, which
    # made sample() raise inside Engine.step. Now the range is [0.01, 100] and the penalty runs in float64.
    big = np.finfo(np.float32).max
    logits = np.array([big, -big, 1.0, 0.5], dtype=np.float32)
    with np.errstate(over="raise"):
        for rp in (0.01, 100.0):
            params = SamplingParams(temperature=0.0, repetition_penalty=rp)
            assert np.isfinite(apply_repetition_penalty(logits, [0, 1], rp)).all()
            assert sample(logits, params, None, seen=[0, 1]) in range(4)
            p = probabilities(logits, SamplingParams(temperature=1.0, repetition_penalty=rp), seen=[0, 1])
            assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-9


def test_probabilities_is_a_tempered_softmax(random_logits):
    for t in (0.3, 1.0, 2.5):
        x = random_logits.astype(np.float64) / t
        expected = np.exp(x - x.max())
        np.testing.assert_allclose(probabilities(random_logits, SamplingParams(temperature=t)),
                                   expected / expected.sum(), rtol=1e-10, atol=1e-15)


def draw_frequencies(logits, params, n=5000, seen=()) -> np.ndarray:
    rng = np.random.default_rng(1234)
    counts = np.bincount([sample(logits, params, rng, seen) for _ in range(n)], minlength=len(logits))
    return counts / n


def assert_matches(freq: np.ndarray, probs: np.ndarray, n: int = 5000) -> None:
    """Tokens with zero probability are never drawn; the rest pass a chi-square test. The draws are seeded, so
    this is deterministic; the bound is the 99.99th percentile of chi-square for these degrees of freedom
    (approximated by mean + 6 standard deviations), i.e. a correct sampler would fail it ~never."""
    assert (freq[probs == 0] == 0).all(), "drew a token the filters removed"
    support = probs > 0
    chi2 = n * np.sum((freq[support] - probs[support]) ** 2 / probs[support])
    dof = support.sum() - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, f"chi2 {chi2:.1f} with {dof} degrees of freedom"


BASE = logits_of([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02])


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]),
    (SamplingParams(temperature=0.5), np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]) ** 2),   # p^(1/T)
    (SamplingParams(top_k=3), [0.4, 0.25, 0.15, 0, 0, 0, 0]),
    (SamplingParams(top_p=0.7), [0.4, 0.25, 0.15, 0, 0, 0, 0]),     # 0.4 + 0.25 = 0.65 < 0.7: token 2 crosses
    (SamplingParams(min_p=0.3), [0.4, 0.25, 0.15, 0, 0, 0, 0]),     # keep p >= 0.12
    (SamplingParams(top_k=2, temperature=2.0), np.sqrt([0.4, 0.25, 0, 0, 0, 0, 0])),
])
def test_sampled_frequencies_match_the_distribution(params, expected):
    expected = np.asarray(expected, dtype=np.float64)
    expected = expected / expected.sum()
    np.testing.assert_allclose(probabilities(BASE, params), expected, atol=1e-6)
    assert_matches(draw_frequencies(BASE, params), expected)


def test_repetition_penalty_changes_the_distribution():
    logits = np.array([1.0, 1.0, -1.0], dtype=np.float32)
    params = SamplingParams(repetition_penalty=2.0)
    # token 0 seen: its logit 1.0 -> 0.5; token 2 seen: -1.0 -> -2.0
    x = np.array([0.5, 1.0, -2.0])
    expected = np.exp(x) / np.exp(x).sum()
    assert_matches(draw_frequencies(logits, params, seen=[0, 2]), expected)


def test_seeded_sampling_is_reproducible(random_logits):
    def run(seed):
        p = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
        rng = p.make_rng()
        return [sample(random_logits, p, rng) for _ in range(50)]
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_sample_only_draws_tokens_with_probability(random_logits):
    # The last token is impossible (-inf) and top-k drops all but 50 tokens: every draw must be one of those 50.
    # (A clamp to the last index would turn a broken draw into the impossible last token: this catches it.)
    logits = random_logits.copy()
    logits[-1] = -np.inf
    p = SamplingParams(temperature=1.0, top_k=50, seed=0)
    rng = p.make_rng()
    allowed = set(np.argsort(logits)[-50:].tolist())
    draws = [sample(logits, p, rng) for _ in range(2000)]
    assert all(isinstance(d, int) for d in draws)
    assert set(draws) <= allowed
    assert len(logits) - 1 not in draws


@pytest.mark.parametrize("temperature", [1e-310, 1e-300, 1e-30])
def test_tiny_temperature_samples_the_argmax(random_logits, temperature):
    # Dividing by 1e-310 before subtracting the max gave inf - inf = NaN everywhere (and the last token id).
    p = SamplingParams(temperature=temperature, seed=0)
    probs = probabilities(random_logits, p)
    assert np.isfinite(probs).all()
    assert probs[np.argmax(random_logits)] == 1.0
    rng = p.make_rng()
    assert {sample(random_logits, p, rng) for _ in range(20)} == {int(np.argmax(random_logits))}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("bad", ["one nan", "all nan", "all -inf", "+inf"])
def test_nan_or_non_finite_logits_raise(random_logits, temperature, bad):
    logits = random_logits.copy()
    if bad == "one nan":
        logits[3] = np.nan
    elif bad == "all nan":
        logits[:] = np.nan
    elif bad == "all -inf":
        logits[:] = -np.inf
    else:
        logits[3] = np.inf
    p = SamplingParams(temperature=temperature, seed=0)
    with pytest.raises(ValueError, match="logits contain NaN"):
        sample(logits, p, p.make_rng())


def test_sample_step_reports_logprobs_only_when_asked():
    from tinyserve.sampling import sample_step
    logits = np.array([1.0, 3.0, 2.0, 0.0], dtype=np.float32)                   # [V]
    logp = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    assert sample_step(logits, SamplingParams(temperature=0), np.random.default_rng(0)) == ([1], None)
    [token], [(lp, top)] = sample_step(logits, SamplingParams(temperature=0, logprobs=2), np.random.default_rng(0))
    assert token == 1 and lp == pytest.approx(logp[1])
    assert [i for i, _ in top] == [1, 2] and [v for _, v in top] == pytest.approx(logp[[1, 2]])
    # the model's distribution, not the sampling one: temperature and top-k do not change the numbers
    _, [(lp_hot, top_all)] = sample_step(logits, SamplingParams(temperature=2.0, top_k=1, logprobs=20, seed=1),
                                         np.random.default_rng(1))
    assert lp_hot == pytest.approx(logp[1]) and [i for i, _ in top_all] == [1, 2, 0, 3]
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs with json_schema"):      # forced tokens have no logprobs
        SamplingParams(logprobs=1, json_schema={"type": "object"})
