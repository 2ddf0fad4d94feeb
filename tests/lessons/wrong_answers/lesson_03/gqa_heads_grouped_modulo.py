"""grouped_attention reshapes q to [m, g, K, H]: query head n reads kv head n % K instead of n // g."""
import numpy as np

from tinyserve.layers import rectangular_mask, softmax

CAUGHT_BY = "grouped_attention"


def grouped_attention(q, k, v):
    m, N, H = q.shape
    S, K, _ = k.shape
    g = N // K
    qg = q.reshape(m, g, K, H).transpose(2, 0, 1, 3).reshape(K, m * g, H)
    scores = qg @ k.transpose(1, 2, 0) / np.float32(np.sqrt(H))
    scores = np.where(np.repeat(rectangular_mask(m, S), g, axis=0)[None], -np.inf, scores)
    out = softmax(scores) @ v.transpose(1, 0, 2)
    return out.reshape(K, m, g, H).transpose(1, 2, 0, 3).reshape(m, N, H)
