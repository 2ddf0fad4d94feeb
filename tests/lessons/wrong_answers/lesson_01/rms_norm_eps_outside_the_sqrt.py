"""rms_norm adds eps after the square root: x / (sqrt(mean(x^2)) + eps)."""
import numpy as np

CAUGHT_BY = "rms_norm"


def rms_norm(x, weight, eps):
    return x / (np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True)) + eps) * weight
