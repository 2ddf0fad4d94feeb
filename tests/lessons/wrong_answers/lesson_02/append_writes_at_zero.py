"""append_kv writes the new block at position 0 instead of after the cache.length cached positions."""
CAUGHT_BY = "append_kv"


def append_kv(cache, layer, k, v):
    m = k.shape[0]
    cache.check_room(m)
    cache.k[layer, :m], cache.v[layer, :m] = k, v
    end = cache.length + m
    return cache.k[layer, :end], cache.v[layer, :end]
