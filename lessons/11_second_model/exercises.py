"""Lesson 11 exercises: a sliding window in the paged engine — which blocks a local layer still reads, giving the
others back, and attention that sees only the window; and the bytes a decode step reads from the real model's
262,144-row LM head.

Replace each `raise NotImplementedError(...)`, then run `make check-11`: it runs tests/lessons/test_lesson_11.py
against this file and tells you, exercise by exercise, what passes. The reference answers are in
tinyserve/kv_sizing.py (first_live_block), tinyserve/block_manager.py (release_behind_window), tinyserve/paged.py
(window_attention) and tinyserve/roofline.py (matrix_bytes): try first, peek later.
"""
from __future__ import annotations

import numpy as np

# The pieces you may build on: the allocator (decref gives a block back), lesson 2's mask (it takes a window),
# softmax and the ceil-division helper.
from tinyserve.kv_sizing import blocks_for  # noqa: F401
from tinyserve.layers import rectangular_mask, softmax  # noqa: F401
from tinyserve.paged import BlockAllocator  # noqa: F401
# The block formats matrix_bytes prices: Q8_0 (Gemma's embedding in its file), the fast path's byte tile, ...
from tinyserve.roofline import BYTE_TILE, BYTE_TILE_NO_MIN, NIBBLE_TILE, Q4_0, Q4_1, Q5_0, Q8_0, BlockFormat  # noqa: F401


def first_live_block(num_computed: int, window: int | None, block_size: int) -> int:
    """The first logical block a local layer still reads once `num_computed` positions are in the cache.

    The next row sits at position num_computed and, with a sliding `window`, sees keys num_computed - window + 1 ..
    num_computed. Return the index of the block holding the oldest of those keys (0 while the window still
    reaches back to position 0, and 0 for a global layer: window None). Every block before it may be freed.
    """
    raise NotImplementedError(
        "first_live_block: which position is the oldest key the next row sees? Which block holds it? Never below 0.")


def release_behind_window(local_table: list[int], num_computed: int, window: int, block_size: int,
                          allocator: BlockAllocator) -> int:
    """Give back the local blocks of one sequence that no future row can read; return how many were freed.

    local_table: [blocks] physical block ids, -1 where a block was already freed; edit it in place: a freed
    entry becomes -1 (so index i still means logical block i). Decref each freed block exactly once (a block
    another owner holds lives on). A second call with the same num_computed frees nothing.
    """
    raise NotImplementedError(
        "release_behind_window: every entry before first_live_block(...) that is not already -1: decref it on the "
        "allocator and mark it -1. Count what you freed.")


def window_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int) -> np.ndarray:
    """Causal attention with a sliding window; the m new rows are the last m of the S keys.

    q: [m, N, H]; k, v: [S, K, H] (K divides N: query head n reads K/V head n // (N // K)) -> [m, N, H].
    Row i sits at key position S - m + i and sees the keys j with S - m + i - window < j <= S - m + i.
    Scores are q.k / sqrt(H); masked scores are -inf before the softmax over the keys.
    """
    raise NotImplementedError(
        "window_attention: lesson 2's rectangular attention (repeat K/V to N heads, scores [N, m, S], softmax, "
        "times V), with rectangular_mask(m, S, window) as the mask.")


def matrix_bytes(rows: int, cols: int, fmt: BlockFormat) -> int:
    """Bytes of a [rows, cols] matrix stored as `fmt`: every run of fmt.block weights along a row is fmt.block
    integers of fmt.bits bits, plus one scale (fmt.scale_bytes) and one minimum (fmt.min_bytes, 0 for none) per
    block. A row of cols weights must be whole blocks: else a ValueError naming the sizes.
    Gemma's LM head: matrix_bytes(262144, 640, Q8_0) is what the file holds; with BYTE_TILE_NO_MIN, what the fast path
    reads (the same: Q8_0's blocks as they are); BYTE_TILE is the byte tile that also stores a minimum.
    """
    raise NotImplementedError(
        "matrix_bytes: how many blocks in a row (cols // fmt.block), how many bytes one block takes (its integers' "
        "bits / 8, the scale, the minimum), times the rows.")
