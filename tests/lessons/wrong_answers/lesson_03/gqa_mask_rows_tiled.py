"""grouped_attention tiles the mask rows (np.tile) instead of repeating each row g times: rows are (i, head) pairs."""
import numpy as np

from tinyserve.layers import rectangular_mask, softmax

CAUGHT_BY = "grouped_attention"


def grouped_attention(q, k, v):
    m, N, H = q.shape
    S, K, _ = k.shape
    g = N // K
    qg = q.reshape(m, K, g, H).transpose(1, 0, 2, 3).reshape(K, m * g, H)
    scores = qg @ k.transpose(1, 2, 0) / np.float32(np.sqrt(H))
    scores = np.where(np.tile(rectangular_mask(m, S), (g, 1))[None], -np.inf, scores)
    out = softmax(scores) @ v.transpose(1, 0, 2)
    return out.reshape(K, m, g, H).transpose(1, 0, 2, 3).reshape(m, N, H)
