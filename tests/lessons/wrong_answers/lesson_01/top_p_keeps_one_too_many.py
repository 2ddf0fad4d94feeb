"""top_p_filter keeps a token while the mass before it is <= p (not < p): at an exact boundary it keeps one too many."""
import numpy as np

CAUGHT_BY = "top_p_filter"


def top_p_filter(probs, p):
    order = np.argsort(-probs, kind="stable")
    before = np.cumsum(probs[order]) - probs[order]
    keep = order[before <= p]
    out = np.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()
