"""Lesson 3 exercises: grouped-query attention and the KV-size formulas. Then run `make check-3`.

The reference answers are in tinyserve/gqa.py and tinyserve/roofline.py: try first, peek later. Shapes use the
legend of tinyserve/config.py (N query heads, K kv heads, g = N // K, H head_dim, S keys, m new rows).
"""
from __future__ import annotations

import numpy as np

from tinyserve.config import ModelConfig
from tinyserve.kv_cache import rectangular_mask  # noqa: F401  (lesson 2's mask: reuse it)
from tinyserve.layers import softmax  # noqa: F401


def grouped_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Causal attention of m new queries over S keys, the last m of which are the new tokens themselves.

    q: [m, N, H]; k, v: [S, K, H] (S >= m) -> [m, N, H].
    The "rectangular" causal mask: the S - m history positions are visible to every new row; inside the new
    block, row i sees new keys 0..i only. Plain prefill is S == m, decode is m == 1 (nothing is masked).
    """
    raise NotImplementedError(
        "grouped_attention: query head n reads K/V head n // g. A reshape of q can turn the g heads of a group into"
        " extra *rows* of that K/V head, so one batched matmul gives every score without copying K or V. The mask "
        "is per new token: which rows of your scores belong to new token i?")


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache one token occupies: 2 (K and V) * L * K * H * bytes per value."""
    raise NotImplementedError(
        "kv_bytes_per_token: the fields are config.n_layers, config.n_kv_heads and config.head_dim")


def kv_cache_bytes(config: ModelConfig, n_tokens: int, n_seqs: int = 1, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache for n_seqs sequences of n_tokens tokens each."""
    raise NotImplementedError("kv_cache_bytes: build on kv_bytes_per_token")
