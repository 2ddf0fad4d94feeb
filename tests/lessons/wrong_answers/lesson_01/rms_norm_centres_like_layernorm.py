"""rms_norm subtracts the row mean first (that is LayerNorm, not RMSNorm)."""
import numpy as np

CAUGHT_BY = "rms_norm"


def rms_norm(x, weight, eps):
    x = x - x.mean(axis=-1, keepdims=True)
    return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * weight
