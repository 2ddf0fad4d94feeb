"""evict_lru evicts blocks that sequences still hold (does not check refcount == 1)."""
from tinyserve.prefix_cache import evict_lru as _reference

CAUGHT_BY = "evict_lru"


def evict_lru(root, num_blocks, refcount, block_size):
    return _reference(root, num_blocks, [1] * len(refcount), block_size)
