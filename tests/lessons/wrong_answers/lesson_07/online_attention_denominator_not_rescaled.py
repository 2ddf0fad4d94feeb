"""online_attention rescales the accumulator when the max grows but not the running sum l: the denominator keeps
the earlier blocks at their old, larger weight."""
import numpy as np

CAUGHT_BY = "online_attention"


def online_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_table: np.ndarray,
                     context_len: int) -> np.ndarray:
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
        l = l + p.sum(axis=-1)
        acc = acc * a[..., None] + np.einsum("tkgn,nkh->tkgh", p, vb)
        mx = new_mx
    return (acc / l[..., None]).reshape(m, N, H).astype(np.float32)
