"""top_p_filter returns the kept probabilities in sorted order instead of scattering them back to their token ids."""
import numpy as np

CAUGHT_BY = "top_p_filter"


def top_p_filter(probs, p):
    sp = np.sort(probs)[::-1]
    before = np.cumsum(sp) - sp
    out = np.where(before < p, sp, 0.0)
    return out / out.sum()
