"""The forward pass on the tiny random model: shapes, causality, logit_rows, token-id validation, the layers."""
from __future__ import annotations

import numpy as np
import pytest

import tinyserve as ts
from tinyserve import naive
from tinyserve.layers import apply_rope, causal_attention, rms_norm, rope_tables, softmax
from tinyserve.model import check_token_ids, forward


def full_attention(layer, q, k, v):
    return causal_attention(q, k, v)


IDS = [5, 17, 200, 3, 99, 42, 7, 7, 128, 64]


def test_shapes_and_dtype(tiny):
    cfg = tiny.config
    logits = naive.forward(tiny, IDS)
    assert logits.shape == (len(IDS), cfg.vocab_size) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert tiny.embed.shape == (cfg.vocab_size, cfg.dim)
    w = tiny.layers[0]
    assert w.wq.shape == (cfg.dim, cfg.n_heads * cfg.head_dim)
    assert w.wk.shape == (cfg.dim, cfg.n_kv_heads * cfg.head_dim)
    assert tiny.rope_cos.shape == (cfg.max_seq_len, cfg.head_dim // 2)


def test_causal(tiny):
    """The logits at position i depend on tokens 0..i only: change what comes later and they stay put."""
    base = naive.forward(tiny, IDS)
    for i in range(len(IDS) - 1):
        changed = IDS[: i + 1] + [(t + 1) % 256 for t in IDS[i + 1:]]
        other = naive.forward(tiny, changed)
        np.testing.assert_allclose(other[: i + 1], base[: i + 1], rtol=1e-5, atol=1e-5)
        assert not np.allclose(other[i + 1:], base[i + 1:], atol=1e-3)   # ... and the later ones do change


def test_prefix_gives_the_same_logits(tiny):
    base = naive.forward(tiny, IDS)
    for n in (1, 4, 9):
        np.testing.assert_allclose(naive.forward(tiny, IDS[:n]), base[:n], rtol=1e-5, atol=1e-5)


def test_logit_rows_equals_slicing(tiny):
    tokens, positions = np.array(IDS), np.arange(len(IDS))
    full = forward(tiny, tokens, positions, full_attention)
    for rows in ([9], [0, 3, 9], [2, 2], list(range(10))):
        np.testing.assert_allclose(forward(tiny, tokens, positions, full_attention, logit_rows=np.array(rows)),
                                   full[rows], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(naive.next_token_logits(tiny, tokens), full[-1], rtol=1e-5, atol=1e-5)


def test_attention_is_pluggable(tiny):
    """forward hands every layer's q, k, v to the attention function, rotated, with the declared shapes."""
    cfg, seen = tiny.config, []

    def spy(layer, q, k, v):
        seen.append((layer, q.shape, k.shape, v.shape))
        return causal_attention(q, k, v)

    forward(tiny, np.array(IDS), np.arange(len(IDS)), spy)
    T, N, K, H = len(IDS), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    assert seen == [(i, (T, N, H), (T, K, H), (T, K, H)) for i in range(cfg.n_layers)]


def test_tiny_model_is_deterministic():
    a, b = ts.tiny_model(seed=3), ts.tiny_model(seed=3)
    np.testing.assert_array_equal(naive.forward(a, IDS), naive.forward(b, IDS))
    assert not np.array_equal(naive.forward(a, IDS), naive.forward(ts.tiny_model(seed=4), IDS))


@pytest.mark.parametrize("ids, match", [
    ([], "empty"),
    ([1, 256], "out of range"),
    ([1, -1], "out of range"),
    ([1.0, 2.0], "integers"),
    ([1, 2.5], "integers"),
    (["a", "b"], "integers"),
    ([True, False], "integers"),
    ([[1, 2], [3, 4]], "flat list"),
    ([[1, 2], [3]], "flat list"),
    (list(range(5)) * 205, "longer than the context window"),   # 1025 > max_seq_len 1024
])
def test_bad_token_ids(tiny, ids, match):
    with pytest.raises(ValueError, match=match):
        check_token_ids(tiny.config, ids)
    with pytest.raises(ValueError, match=match):
        naive.forward(tiny, ids)


def test_good_token_ids(tiny):
    arr = check_token_ids(tiny.config, np.array([0, 255], dtype=np.uint8))
    assert arr.dtype == np.int64 and arr.tolist() == [0, 255]
    assert check_token_ids(tiny.config, [0] * 1024).shape == (1024,)   # exactly the context window is fine


# --- the layers ----------------------------------------------------------------------------------------------

def test_rms_norm():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], dtype=np.float32)
    out = rms_norm(x[:1], np.array([1.0, 2.0], dtype=np.float32), eps=0.0)
    rms = np.sqrt((9 + 16) / 2)
    np.testing.assert_allclose(out[0], [3 / rms, 2 * 4 / rms], rtol=1e-6)
    assert np.isfinite(rms_norm(x, np.ones(2, np.float32), eps=1e-5)).all()   # eps keeps a zero row finite


def test_rope_rotates_and_is_relative():
    cos, sin = rope_tables(64, 8, 10000.0)
    assert np.allclose(cos[0], 1) and np.allclose(sin[0], 0)                 # position 0: no rotation
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 1, 8)).astype(np.float32), rng.standard_normal((1, 1, 8)).astype(np.float32)
    rot = lambda x, p: apply_rope(x, cos[p:p + 1], sin[p:p + 1])  # noqa: E731
    np.testing.assert_allclose(np.linalg.norm(rot(q, 17)), np.linalg.norm(q), rtol=1e-5)   # a rotation
    # the score depends on the distance between positions only: (3, 10) scores like (20, 27)
    s1 = float((rot(q, 10) * rot(k, 3)).sum())
    s2 = float((rot(q, 27) * rot(k, 20)).sum())
    assert s1 == pytest.approx(s2, rel=1e-4, abs=1e-5)


def test_softmax_is_stable():
    p = softmax(np.array([1000.0, 1000.0, -np.inf]))
    np.testing.assert_allclose(p, [0.5, 0.5, 0.0])


def test_causal_attention_first_token_sees_itself_only():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((4, 4, 8)), rng.standard_normal((4, 2, 8)), rng.standard_normal((4, 2, 8))
    out = causal_attention(q, k, v)
    assert out.shape == (4, 4, 8)
    # with one visible key the softmax weight is 1: the output is that key's value, shared by its group
    np.testing.assert_allclose(out[0], np.repeat(v[0], 2, axis=0))


@pytest.mark.real
def test_real_model_shapes(smol):
    logits = naive.forward(smol, [1, 520, 9531, 198])
    assert logits.shape == (4, 49152) and logits.dtype == np.float32
    assert smol.embed.dtype == np.float32 and smol.layers[0].wq.flags.c_contiguous
