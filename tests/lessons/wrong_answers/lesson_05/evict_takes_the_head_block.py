"""evict_lru removes blocks from the head of a leaf's edge instead of its tail (strands the blocks after it)."""
import heapq

from tinyserve.prefix_cache import iter_nodes

CAUGHT_BY = "evict_lru"


def evict_lru(root, num_blocks, refcount, block_size):
    bs = block_size
    heap = [(leaf.last_access, i, leaf) for i, leaf in enumerate(iter_nodes(root)) if not leaf.children]
    heapq.heapify(heap)
    tie, evicted = len(heap), []
    while heap and len(evicted) < num_blocks:
        _, _, leaf = heapq.heappop(heap)
        key = leaf.tokens[:bs]
        while leaf.blocks and len(evicted) < num_blocks and refcount[leaf.blocks[0]] == 1:
            evicted.append(leaf.blocks.pop(0))
            leaf.tokens = leaf.tokens[bs:]
        if leaf.blocks:
            continue
        parent = leaf.parent
        del parent.children[key]
        if parent is not root and not parent.children:
            heapq.heappush(heap, (parent.last_access, tie, parent))
            tie += 1
    return evicted
