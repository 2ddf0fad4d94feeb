"""Lesson 7: attention over paged KV blocks with an online softmax (FlashAttention's rule), in NumPy.

The two-pass way (tinyserve.paged.paged_attention) gathers a sequence's K and V out of the pool into contiguous
copies, computes all its scores [m, N, S], then their softmax, then the weighted sum of V: it holds O(S) per row.
The online way reads the blocks in place, one at a time, and keeps per (row, head) only three things: the largest
score so far m, the sum l of exp(s - m) over the keys so far, and acc, the sum of exp(s - m) v over them. When a block
raises the largest score from m to m', everything summed so far was weighted against the old m, so l and acc are
both multiplied by exp(m - m') before the block's own terms join them:

    m' = max(m, max_j s_j)    a = exp(m - m')    l' = a l + sum_j exp(s_j - m')    acc' = a acc + sum_j exp(s_j - m') v_j

and out = acc / l after the last block (Milakov & Gimelshein, 2018; Dao et al., FlashAttention, 2022). Nothing of
size S is held: that is what lets a GPU kernel keep its tile in on-chip memory, and what kernels/attention.py does in
Numba (chunks of 64 positions in a fixed order, kernels/key_chunks.py).
"""
from __future__ import annotations

import numpy as np


def online_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                     context_len: int) -> np.ndarray:
    """Causal attention of one sequence's m newest rows over its paged K/V, block by block with an online softmax.

    q [m, N, H]: the queries of positions context_len - m .. context_len - 1 (row t is position context_len - m + t
    and sees positions 0 .. context_len - m + t). k_cache, v_cache [num_blocks, bs, K, H]: the pool, already holding
    the new rows' K/V; position p of the sequence is slot p % bs of block block_table[p // bs]. Query head h reads
    K/V head h // (N / K) (GQA). -> [m, N, H] float32, equal to paged.paged_attention up to float rounding.
    """
    m, N, H = q.shape
    _, bs, K, _ = k_cache.shape
    g = N // K
    n_blocks = -(-context_len // bs)                                  # the last block may be partly filled
    if not m <= context_len <= len(block_table) * bs:
        raise ValueError(f"online_attention: {m} query rows and context_len {context_len} with a block table of "
                         f"{len(block_table)} blocks of {bs} (need m <= context_len <= blocks * bs)")
    scale = np.float32(1.0 / np.sqrt(H))
    qg = q.reshape(m, K, g, H)                                        # query head h = kh * g + r reads K/V head kh
    row_pos = context_len - m + np.arange(m)                          # [m] each row's position
    mx = np.full((m, K, g), -np.inf, np.float32)                      # running max of the scores
    l = np.zeros((m, K, g), np.float32)                               # running sum of exp(s - mx)
    acc = np.zeros((m, K, g, H), np.float32)                          # running sum of exp(s - mx) * v
    for i in range(n_blocks):
        n = min(bs, context_len - i * bs)                             # positions of this block that exist
        kb = k_cache[block_table[i], :n]                              # [n, K, H], a view: nothing copied
        vb = v_cache[block_table[i], :n]
        s = np.einsum("tkgh,nkh->tkgn", qg, kb) * scale               # [m, K, g, n]
        visible = i * bs + np.arange(n)[None, :] <= row_pos[:, None]  # [m, n] causal: key position <= row position
        s = np.where(visible[:, None, None, :], s, np.float32(-np.inf))
        new_mx = np.maximum(mx, s.max(axis=-1))                       # finite: every row sees position 0 in block 0
        a = np.exp(mx - new_mx)                                       # 0 for the first block (exp(-inf))
        p = np.exp(s - new_mx[..., None])                             # [m, K, g, n]; 0 where masked
        l = l * a + p.sum(axis=-1)
        acc = acc * a[..., None] + np.einsum("tkgn,nkh->tkgh", p, vb)
        mx = new_mx
    return (acc / l[..., None]).reshape(m, N, H).astype(np.float32)
