"""top_p_filter keeps tokens while the running mass *including* them is < p: the token that crosses p is dropped."""
import numpy as np

CAUGHT_BY = "top_p_filter"


def top_p_filter(probs, p):
    order = np.argsort(-probs, kind="stable")
    keep_sorted = np.cumsum(probs[order]) < p
    keep_sorted[0] = True
    out = np.zeros_like(probs)
    out[order[keep_sorted]] = probs[order[keep_sorted]]
    return out / out.sum()
