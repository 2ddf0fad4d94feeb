"""top_p_filter zeroes the dropped tokens but does not renormalise the kept ones to sum to 1."""
import numpy as np

CAUGHT_BY = "top_p_filter"


def top_p_filter(probs, p):
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    out = np.zeros_like(probs)
    out[order[before < p]] = probs[order[before < p]]
    return out
