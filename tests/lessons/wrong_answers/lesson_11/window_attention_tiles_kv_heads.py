"""window_attention repeats the K/V heads with np.tile: query head n reads K/V head n % K instead of n // g."""
import numpy as np

from tinyserve.layers import rectangular_mask, softmax

CAUGHT_BY = "window_attention"


def window_attention(q, k, v, window):
    m, N, H = q.shape
    S, K, _ = k.shape
    k, v = np.tile(k, (1, N // K, 1)), np.tile(v, (1, N // K, 1))
    scores = q.transpose(1, 0, 2) @ k.transpose(1, 2, 0) / np.float32(np.sqrt(H))
    scores[:, rectangular_mask(m, S, window)] = -np.inf
    return (softmax(scores) @ v.transpose(1, 0, 2)).transpose(1, 0, 2)
