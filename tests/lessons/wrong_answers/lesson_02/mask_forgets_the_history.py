"""rectangular_mask puts the new rows at positions 0..m-1 (the square triangle), hiding history from every new row."""
import numpy as np

CAUGHT_BY = "rectangular_mask"


def rectangular_mask(m, S):
    return np.arange(S)[None, :] > np.arange(m)[:, None]
