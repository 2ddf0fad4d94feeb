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
        "rms_norm: take the mean of x**2 over the last axis (keepdims=True so it broadcasts over D), "
        "add eps, take 1/sqrt, multiply by x and by weight")


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
        "apply_rope: split x into x1 = x[..., :H/2] and x2 = x[..., H/2:]; give cos and sin a heads axis "
        "(cos[:, None, :]) so they broadcast; concatenate [x1*c - x2*s, x2*c + x1*s] on the last axis")


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """exp(x) normalised to sum to 1 along `axis` (any shape in, the same shape out).

    Must not overflow for large inputs (e.g. logits of 1000), and an entry of -inf must get probability 0
    (that is how the causal mask hides future tokens).
    """
    raise NotImplementedError(
        "softmax: subtract the max along `axis` (keepdims=True) before np.exp: it changes nothing "
        "mathematically and keeps exp from overflowing; then divide by the sum along `axis`")


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Lesson 1's attention: every token attends to itself and all earlier tokens.

    q: [T, N, H], k and v: [T, K, H] -> [T, N, H]. With grouped-query attention (K < N) each K/V head serves
    g = N // K query heads; here we simply repeat K and V g times (lesson 3 shows how to avoid the copy).

    For query head n, token t:  out[t, n] = sum_s softmax_s(q[t, n] . k[s, n // g] / sqrt(H)) * v[s, n // g],
    where the softmax runs over s = 0..t only (keys after the query are masked out).
    """
    raise NotImplementedError(
        "causal_attention: np.repeat(k, g, axis=1) (and v) so query head n meets kv head n // g; put the head "
        "axis first with transpose so scores = q @ k^T is [N, T, T]; scale by 1/sqrt(H); set the entries above "
        "the diagonal (np.triu(..., k=1)) to -inf; your softmax over the last axis; @ v; transpose back to [T, N, H]")


def top_p_filter(probs: np.ndarray, p: float) -> np.ndarray:  # [V] probabilities -> [V], renormalised
    """Nucleus sampling: keep the most likely tokens until their mass reaches p, *including* the token that
    crosses the threshold (otherwise a single token with probability 0.95 and p=0.9 would keep nothing).

    probs: [V] probabilities summing to 1; p in (0, 1], where p >= 1 means "keep everything".
    Returns [V]: the kept probabilities renormalised to sum to 1, zeros elsewhere, in the original token
    order. Do not modify `probs` in place.
    """
    raise NotImplementedError(
        "top_p_filter: sort token ids by probability, descending (np.argsort(-probs, kind='stable')); a token is "
        "kept if the mass of the tokens *before* it in that order is still < p (np.cumsum minus itself); "
        "scatter the kept probabilities back to their ids and divide by their sum")
