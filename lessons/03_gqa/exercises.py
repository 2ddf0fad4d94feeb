"""Lesson 3 exercises: grouped-query attention and the bytes decode attention moves. Then run `make check-3`.

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


def attention_decode_bytes(config: ModelConfig, context: int, bytes_per_value: int = 4,
                           repeat_kv: bool = False) -> int:
    """Bytes one decode step's attention moves through memory, all layers: one new query row over `context` cached
    positions, every value `bytes_per_value` bytes.

    repeat_kv=False: grouped attention (yours above): every cached K and V value is read once.
    repeat_kv=True: lesson 2's attention (kv_cache.rectangular_attention): it also makes the np.repeat copies, writes
    them to memory and reads them back for its matmuls. Count that traffic too.
    Ignore the query, the output and the scores: they are a few per cent of the cache traffic.
    For SmolLM2, repeat_kv=True should come out ~7x repeat_kv=False: derive the factor, do not type it.
    """
    raise NotImplementedError(
        "attention_decode_bytes: per layer and per cached position, how many values of K and of V does the cache "
        "hold? With repeat_kv, what shape does np.repeat return, and how many times does that copy cross memory? "
        "Which heads count there: the ones the cache stores, or the ones the queries have?")
