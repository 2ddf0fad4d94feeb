"""causal_attention forgets to divide the scores by sqrt(H)."""
import numpy as np

from tinyserve.layers import softmax

CAUGHT_BY = "causal_attention"


def causal_attention(q, k, v):
    T, N, H = q.shape
    g = N // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)
    scores[:, np.triu(np.ones((T, T), bool), k=1)] = -np.inf
    return (softmax(scores) @ v.transpose(1, 0, 2)).transpose(1, 0, 2)
