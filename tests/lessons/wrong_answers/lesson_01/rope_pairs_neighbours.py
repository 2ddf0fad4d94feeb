"""apply_rope rotates neighbouring dimensions (2i, 2i+1) together instead of i and i + H/2 (the wrong layout)."""
import numpy as np

CAUGHT_BY = "apply_rope"


def apply_rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x2 * c + x1 * s
    return out
