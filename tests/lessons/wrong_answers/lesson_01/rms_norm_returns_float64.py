"""rms_norm computes in float64 and returns float64 (the model is float32 end to end)."""
import numpy as np

CAUGHT_BY = "rms_norm"


def rms_norm(x, weight, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + eps) * weight
