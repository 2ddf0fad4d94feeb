"""rectangular_mask returns True where a key is visible (the opposite convention to the docstring's)."""
import numpy as np

CAUGHT_BY = "rectangular_mask"


def rectangular_mask(m, S):
    return np.arange(S)[None, :] <= (S - m + np.arange(m))[:, None]
