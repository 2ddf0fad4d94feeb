"""Lesson 1 exercises: the pieces of a LLaMA block, and nucleus (top-p) filtering.

Replace each `raise NotImplementedError(...)` with your code, then run `make check-1`: it runs the checks in
tests/lessons/test_lesson_01.py against this file and tells you, exercise by exercise, what passes.
The reference answers live in tinyserve/layers.py and tinyserve/sampling.py: try first, compare after.

Shapes use the legend in tinyserve/config.py: T tokens, D hidden size, N query heads, K key/value heads,
H head_dim, V vocabulary size. Everything is float32 NumPy; no loops over tokens are needed.
"""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:  # [T, D], [D] -> [T, D]
    """RMSNorm: divide each row of x by its root-mean-square, then scale by `weight`.

        rms_norm(x)[t] = x[t] / sqrt(mean_d(x[t, d]^2) + eps) * weight

    x: [T, D] float32, weight: [D], eps: a small float that keeps an all-zero row finite. Returns [T, D].
    Unlike LayerNorm there is no mean subtraction and no bias.
    """
    raise NotImplementedError(
        "rms_norm: which axis holds the D features of one token? Reduce over it so that the result still broadcasts"
        " against x, and mind where eps sits in the formula above")


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:  # [T, heads, H], [T, H/2] x2 -> same
    """Rotary position embedding: rotate pairs of dimensions of every head by a position-dependent angle.

    x: [T, heads, H] (queries or keys of T tokens), cos and sin: [T, H/2], the cos/sin of angle
    position[t] * freq[i] for each frequency i (see tinyserve.layers.rope_tables). Returns [T, heads, H].

    The pairing is "rotate half" (Hugging Face's convention, which these weights were trained with):
    dimension i rotates together with dimension i + H/2, for i < H/2:

        out[..., i]       = x[..., i] * cos[i] - x[..., i + H/2] * sin[i]
        out[..., i + H/2] = x[..., i + H/2] * cos[i] + x[..., i] * sin[i]

    Every head of a token is rotated by the same angles.
    """
    raise NotImplementedError(
        "apply_rope: the formula pairs the first half of the last axis with the second half. cos and sin have no "
        "heads axis: how do you make them broadcast over [T, heads, H/2]?")


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x) normalised to sum to 1 along `axis` (any shape in, the same shape out).

    Must not overflow for large inputs (e.g. logits of 1000), and an entry of -inf must get probability 0
    (that is how the causal mask hides future tokens).
    """
    raise NotImplementedError(
        "softmax: exp(1000) overflows. What can you subtract from every entry of one row without changing the "
        "result? (Each row on its own, along `axis`.)")


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Lesson 1's attention: every token attends to itself and all earlier tokens.

    q: [T, N, H], k and v: [T, K, H] -> [T, N, H]. With grouped-query attention (K < N) each K/V head serves
    g = N // K query heads; here we simply repeat K and V g times (lesson 3 shows how to avoid the copy).

    For query head n, token t:  out[t, n] = sum_s softmax_s(q[t, n] . k[s, n // g] / sqrt(H)) * v[s, n // g],
    where the softmax runs over s = 0..t only (keys after the query are masked out).
    """
    raise NotImplementedError(
        "causal_attention: first give K and V one head per query head (which query heads share kv head 0?); with "
        "the head axis first, one matmul gives all T x T scores of a head. Hide the future with -inf (your softmax "
        "turns it into 0), weigh the values, and put the axes back")


def top_p_filter(probs: np.ndarray, p: float) -> np.ndarray:  # [V] probabilities -> [V], renormalised
    """Nucleus sampling: keep the most likely tokens until their mass reaches p, *including* the token that
    crosses the threshold (otherwise a single token with probability 0.95 and p=0.9 would keep nothing).

    probs: [V] probabilities summing to 1; p in (0, 1], where p >= 1 means "keep everything".
    Returns [V]: the kept probabilities renormalised to sum to 1, zeros elsewhere, in the original token
    order. Do not modify `probs` in place.
    """
    raise NotImplementedError(
        "top_p_filter: visit the tokens from most to least likely; a token is kept while the mass of the tokens "
        "*before* it is still below p. After sorting, put the kept probabilities back at their own token ids")
