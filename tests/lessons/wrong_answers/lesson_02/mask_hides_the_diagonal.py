"""rectangular_mask also hides each new row's own key (>= instead of >)."""
import numpy as np

CAUGHT_BY = "rectangular_mask"


def rectangular_mask(m, S):
    return np.arange(S)[None, :] >= (S - m + np.arange(m))[:, None]
