"""append_kv writes what fits and only then raises KVCacheFull (a half-written block)."""
from tinyserve.kv_cache import KVCacheFull

CAUGHT_BY = "append_kv"


def append_kv(cache, layer, k, v):
    m = k.shape[0]
    start, end = cache.length, cache.length + m
    cache.k[layer, start:end], cache.v[layer, start:end] = k[:cache.max_len - start], v[:cache.max_len - start]
    if end > cache.max_len:
        raise KVCacheFull("full")
    return cache.k[layer, :end], cache.v[layer, :end]
