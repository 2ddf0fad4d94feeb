"""Lesson 3: grouped-query attention without materialising repeated K/V.

SmolLM2 has N = 9 query heads but only K = 3 key/value heads: each K/V head is shared by a group of g = 3
query heads. Instead of copying K and V g times (np.repeat), reshape the queries to [K, g, ...] so that one
batched matmul lets every query head of a group read the same K/V head.
"""
from __future__ import annotations

import numpy as np

from .layers import rectangular_mask, softmax


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention of m new queries over S keys, the last m of which are the new tokens themselves.

    q: [m, N, H]; k, v: [S, K, H] (S >= m) -> [m, N, H].
    The "rectangular" causal mask: the S - m history positions are visible to every new row; inside the new
    block, row i sees new keys 0..i only. Plain prefill is S == m, decode is m == 1 (nothing is masked).
    """
    m, N, H = q.shape
    S, K, _ = k.shape
    g = N // K
    qg = q.reshape(m, K, g, H).transpose(1, 0, 2, 3).reshape(K, m * g, H)   # [K, m*g, H]: rows (i, head)
    scores = qg @ k.transpose(1, 2, 0)                                       # [K, m*g, S]
    scores *= np.float32(1.0 / np.sqrt(H))
    if m > 1:
        future = rectangular_mask(m, S)                                      # [m, S]: lesson 2's mask
        scores = np.where(np.repeat(future, g, axis=0)[None], np.float32(-np.inf), scores)  # rows are (i, head)
    out = softmax(scores) @ v.transpose(1, 0, 2)                             # [K, m*g, H]
    return out.reshape(K, m, g, H).transpose(1, 0, 2, 3).reshape(m, N, H)
