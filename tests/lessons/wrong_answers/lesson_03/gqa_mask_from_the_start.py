"""grouped_attention uses the square triangle for m rows (row i sees keys 0..i), forgetting the S - m history keys."""
import numpy as np

from tinyserve.layers import softmax

CAUGHT_BY = "grouped_attention"


def grouped_attention(q, k, v):
    m, N, H = q.shape
    S, K, _ = k.shape
    g = N // K
    qg = q.reshape(m, K, g, H).transpose(1, 0, 2, 3).reshape(K, m * g, H)
    scores = qg @ k.transpose(1, 2, 0) / np.float32(np.sqrt(H))
    future = np.arange(S)[None, :] > np.arange(m)[:, None]
    scores = np.where(np.repeat(future, g, axis=0)[None], -np.inf, scores)
    out = softmax(scores) @ v.transpose(1, 0, 2)
    return out.reshape(K, m, g, H).transpose(1, 0, 2, 3).reshape(m, N, H)
