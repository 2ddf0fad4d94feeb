"""apply_mask gives the disallowed tokens -1e9 instead of -inf: the same argmax and nearly the same probabilities,
but not impossible (a large temperature or a logit bias brings them back), and -1e9 is not what the engine tests for."""
import numpy as np

CAUGHT_BY = "apply_mask"


def apply_mask(logits, allowed):
    return np.where(allowed, logits, -1e9).astype(logits.dtype, copy=False)
