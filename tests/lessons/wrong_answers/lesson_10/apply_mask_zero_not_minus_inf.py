"""apply_mask writes 0 for the disallowed tokens: a disallowed 0 beats every allowed token with a negative logit."""
import numpy as np

CAUGHT_BY = "apply_mask"


def apply_mask(logits, allowed):
    return np.where(allowed, logits, 0.0).astype(logits.dtype)
