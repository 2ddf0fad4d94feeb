"""evict_lru empties a parent as soon as its last child goes (depth first), before older leaves elsewhere (not LRU)."""
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
        while leaf is not root and not leaf.children:       # the mistake: climb at once, whatever the clock says
            key = leaf.tokens[:bs]
            while leaf.blocks and len(evicted) < num_blocks and refcount[leaf.blocks[-1]] == 1:
                evicted.append(leaf.blocks.pop())
                leaf.tokens = leaf.tokens[:-bs]
            if leaf.blocks:
                break
            parent = leaf.parent
            del parent.children[key]
            leaf = parent
    return evicted
