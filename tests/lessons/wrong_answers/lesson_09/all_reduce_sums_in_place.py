"""all_reduce accumulates into the callers' arrays: the partial sums they passed in are overwritten."""
import numpy as np

CAUGHT_BY = "all_reduce"


def all_reduce(parts, link):
    P = len(parts)
    chunks = [np.array_split(p, P, axis=-1) for p in parts]            # views into the inputs: no copy
    for s in range(P - 1):
        sent = [link.send(chunks[d][(d - s) % P]) for d in range(P)]
        for d in range(P):
            chunks[d][(d - 1 - s) % P] += sent[(d - 1) % P]
    for s in range(P - 1):
        sent = [link.send(chunks[d][(d + 1 - s) % P]) for d in range(P)]
        for d in range(P):
            chunks[d][(d - s) % P][...] = sent[(d - 1) % P]
    return [np.concatenate(c, axis=-1) for c in chunks]
