"""append_kv returns np.concatenate(history, new) copies instead of views of the cache (a copy per layer per token)."""
import numpy as np

CAUGHT_BY = "append_kv"


def append_kv(cache, layer, k, v):
    m = k.shape[0]
    cache.check_room(m)
    start = cache.length
    cache.k[layer, start:start + m], cache.v[layer, start:start + m] = k, v
    return (np.concatenate([cache.k[layer, :start], k]), np.concatenate([cache.v[layer, :start], v]))
