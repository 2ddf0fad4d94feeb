"""match_prefix keeps walking into a node's children after a mismatch inside its edge (returns another prefix's blocks)."""
from tinyserve.prefix_cache import Match, block_tokens, edge_agreement

CAUGHT_BY = "match_prefix"


def match_prefix(root, tokens, block_size):
    bs, n = block_size, len(tokens) // block_size
    node, depth, blocks, i = root, 0, [], 0
    while i < n:
        child = node.children.get(block_tokens(tokens, i, bs))
        if child is None:
            break
        k = edge_agreement(child, tokens, i, n, bs)
        blocks += child.blocks[:k]
        i += k
        node, depth = child, k          # the mistake: no `break` when k < len(child.blocks)
    return Match(blocks, node, depth)
