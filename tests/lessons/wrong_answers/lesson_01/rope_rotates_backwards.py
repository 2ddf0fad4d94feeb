"""apply_rope rotates by minus the angle (sign of sin flipped): scores still depend on distance only, but mirrored."""
import numpy as np

CAUGHT_BY = "apply_rope"


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1)
