"""softmax always normalises the last axis, whatever `axis` says."""
import numpy as np

CAUGHT_BY = "softmax"


def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)
