"""evict_lru only considers the leaves it found at the start: a parent whose last child went never becomes a leaf."""
import heapq

from tinyserve.prefix_cache import iter_nodes

CAUGHT_BY = "evict_lru"


def evict_lru(root, num_blocks, refcount, block_size):
    bs = block_size
    heap = [(leaf.last_access, i, leaf) for i, leaf in enumerate(iter_nodes(root)) if not leaf.children]
    heapq.heapify(heap)
    evicted = []
    while heap and len(evicted) < num_blocks:
        _, _, leaf = heapq.heappop(heap)
        key = leaf.tokens[:bs]
        while leaf.blocks and len(evicted) < num_blocks and refcount[leaf.blocks[-1]] == 1:
            evicted.append(leaf.blocks.pop())
            leaf.tokens = leaf.tokens[:-bs]
        if not leaf.blocks:
            del leaf.parent.children[key]
    return evicted
