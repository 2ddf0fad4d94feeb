"""append_kv refuses a block that fills the cache exactly (>= instead of >)."""
from tinyserve.kv_cache import KVCacheFull

CAUGHT_BY = "append_kv"


def append_kv(cache, layer, k, v):
    m = k.shape[0]
    if cache.length + m >= cache.max_len:
        raise KVCacheFull("full")
    start, end = cache.length, cache.length + m
    cache.k[layer, start:end], cache.v[layer, start:end] = k, v
    return cache.k[layer, :end], cache.v[layer, :end]
