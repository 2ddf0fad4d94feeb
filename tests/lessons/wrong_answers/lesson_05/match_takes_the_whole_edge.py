"""match_prefix takes a child's whole edge once its first block (the key) matches, without comparing the rest."""
from tinyserve.prefix_cache import Match, block_tokens

CAUGHT_BY = "match_prefix"


def match_prefix(root, tokens, block_size):
    bs, n = block_size, len(tokens) // block_size
    node, depth, blocks, i = root, 0, [], 0
    while i < n:
        child = node.children.get(block_tokens(tokens, i, bs))
        if child is None:
            break
        blocks += child.blocks
        i += len(child.blocks)
        node, depth = child, len(child.blocks)
    return Match(blocks, node, depth)
