"""Lesson 2 exercises: the KV cache. Replace each `raise NotImplementedError(...)`, then run `make check-2`.

The four pieces build on each other: append_kv stores one layer's new K/V, rectangular_mask says which keys a new
row may see, forward_with_cache runs new tokens through the model on top of the cache (prefill and decode are the
same step), and generate is the loop around it. The reference answers are in tinyserve/kv_cache.py: try first,
peek later. Shapes use the legend of tinyserve/config.py (L layers, K kv heads, H head_dim, S cached + new
positions, m new positions, V vocabulary).

With `make lesson-2 LEARNER=1` (or TINYSERVE_SOLUTION=learner) the notebook and `python -m tinyserve generate`
run on the functions you have implemented here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# The pieces you may build on: the cache type and its overflow error, lesson 3's attention over history + new keys,
# the model's forward (it takes attention as a function), sampling, and the set-up every generate loop shares.
from tinyserve.gqa import grouped_attention  # noqa: F401
from tinyserve.kv_cache import AttendFn, KVCache, KVCacheFull  # noqa: F401
from tinyserve.model import Model, check_token_ids, forward as model_forward  # noqa: F401
from tinyserve.kv_sizing import max_kv_positions  # noqa: F401
from tinyserve.sampling import SamplingParams, sample  # noqa: F401
from tinyserve.stopping import start_request  # noqa: F401


def append_kv(cache: KVCache, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Write one layer's new block after the `cache.length` cached positions; return history + new block.

    k, v: [m, K, H] -> (k_all, v_all): [cache.length + m, K, H] views into the cache (no copy).
    `cache.length` is NOT advanced here: every layer appends at the same positions during one forward, so the
    caller advances it once, after the last layer. Raises KVCacheFull if the block does not fit.
    """
    raise NotImplementedError(
        "append_kv: where does the new block go in cache.k[layer], and what must be true before anything is "
        "written? (KVCache has a method for that.) Slices of the cache are views: returning them copies nothing")


def rectangular_mask(m: int, S: int, window: int | None = None) -> np.ndarray:
    """[m, S] bool, True where new row i must NOT see key j (key j is in row i's future).

    The m new positions are the last m of the S keys, so row i sits at absolute position S - m + i and sees
    every key j <= S - m + i: all S - m history keys plus new keys 0..i. Decode (m = 1) masks nothing;
    plain prefill (S = m) is lesson 1's triangle. `window` is lesson 11's sliding window (a local layer also
    stops seeing keys `window` or more positions behind the row); this lesson always passes None.
    """
    raise NotImplementedError(
        "rectangular_mask: compare each key's index with each new row's absolute position; NumPy broadcasting of "
        "a row vector against a column vector builds the whole [m, S] table in one expression")


def forward_with_cache(model: Model, cache: KVCache, tokens: Sequence[int], attend: AttendFn | None = None,
                       all_logits: bool = False) -> np.ndarray:
    """Run m new tokens after the cache's history and append their K/V: the one step of prefill and decode.

    tokens: [m] ids that follow the cache.length positions already cached. `model_forward(model, tokens,
    positions, attention, logit_rows)` runs the whole model and calls `attention(layer, q, k, v)` once per layer
    with this step's q [m, N, H] and k, v [m, K, H]; `attend(q, k_all, v_all)` is attention over history + new keys
    (None: `grouped_attention`, lesson 3's; the reference picks the model backend's kernel there, lesson 7).
    Returns logits [m, V] if all_logits else [1, V] (only the last row: the LM head is the largest matmul).
    Afterwards cache.length has grown by m. Raises KVCacheFull (before writing anything) if m positions do not fit.
    """
    raise NotImplementedError(
        "forward_with_cache: three questions. Which positions do the new tokens have (RoPE needs them)? What "
        "attention function do you hand model_forward so that each layer stores its k, v and sees the history? "
        "When, and by how much, does cache.length change?")


def generate(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
             params: SamplingParams | None = None, tokenizer=None) -> list[int]:
    """Prefill + decode loop: the new token ids only (prompt excluded), ending with EOS if it stopped there.

    The same tokens as naive.generate, greedy or sampled with the same seed, at a cost per token that no longer
    grows with the matmuls: the prompt runs through the model once, then each new token once.
    """
    raise NotImplementedError(
        "generate: naive.generate_stream is the model (start_request gives the prompt, a StopChecker and the "
        "request's rng). How many positions can this request ever hold (max_kv_positions)? Which logits does "
        "the first sample use, and which tokens still have to go through forward_with_cache after that?")
