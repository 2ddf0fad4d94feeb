"""Lesson 2 exercises: the KV cache. Replace each `raise NotImplementedError(...)`, then run `make check-2`.

The reference answers are in tinyserve/kv_cache.py: try first, peek later. Shapes use the legend of
tinyserve/config.py (L layers, K kv heads, H head_dim, S cached + new positions, m new positions).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# The pieces you may build on: the cache type, its overflow error, the model step, sampling and stopping.
from tinyserve.kv_cache import KVCache, KVCacheFull, forward_with_cache, prefill  # noqa: F401
from tinyserve.model import Model, check_token_ids  # noqa: F401
from tinyserve.sampling import SamplingParams, sample  # noqa: F401
from tinyserve.stopping import StopChecker, start_request  # noqa: F401


def append_kv(cache: KVCache, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Write one layer's new block after the `cache.length` cached positions; return history + new block.

    k, v: [m, K, H] -> (k_all, v_all): [cache.length + m, K, H] views into the cache (no copy).
    `cache.length` is NOT advanced here: every layer appends at the same positions during one forward, so the
    caller advances it once, after the last layer. Raises KVCacheFull if the block does not fit.
    """
    raise NotImplementedError(
        "append_kv: call cache.check_room(m) first (it raises KVCacheFull), then store k and v into "
        "cache.k[layer, start:end] / cache.v[layer, start:end] with start = cache.length, and return the slices "
        "cache.k[layer, :end], cache.v[layer, :end]")


def rectangular_mask(m: int, S: int) -> np.ndarray:
    """[m, S] bool, True where new row i must NOT see key j (key j is in row i's future).

    The m new positions are the last m of the S keys, so row i sits at absolute position S - m + i and sees
    every key j <= S - m + i: all S - m history keys plus new keys 0..i. Decode (m = 1) masks nothing;
    plain prefill (S = m) is lesson 1's triangle.
    """
    raise NotImplementedError(
        "rectangular_mask: compare a row of key indices np.arange(S)[None, :] with a column of each new row's "
        "absolute position (S - m + np.arange(m))[:, None]; broadcasting gives the [m, S] mask")


def generate(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
             params: SamplingParams | None = None, tokenizer=None) -> list[int]:
    """Prefill + decode loop: the new token ids only (prompt excluded), ending with EOS if it stopped there.

    Same tokens as naive.generate (greedy), at a cost per token that no longer grows with the matmuls.
    """
    raise NotImplementedError(
        "generate: start as naive.generate_stream does: start_request(...) gives (tokens, stopper, rng); "
        "allocate a KVCache for prompt + max_new_tokens positions (at most config.max_seq_len); prefill() gives "
        "the logits of the first new token; then loop: sample, append to the output, stop if the StopChecker "
        "says so, else forward_with_cache(model, cache, [token])[0] gives the next logits")
