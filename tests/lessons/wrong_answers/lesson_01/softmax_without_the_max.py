"""softmax exponentiates the raw logits (no max subtracted): exp(1000) overflows to inf."""
import numpy as np

CAUGHT_BY = "softmax"


def softmax(x, axis=-1):
    e = np.exp(x)
    return e / np.sum(e, axis=axis, keepdims=True)
