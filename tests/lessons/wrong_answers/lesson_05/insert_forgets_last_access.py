"""insert does not refresh last_access on the nodes of the path it walks (only the new leaf gets `now`)."""
from tinyserve.prefix_cache import Node, block_tokens, edge_agreement, split

CAUGHT_BY = "insert"


def insert(root, tokens, blocks, block_size, now):
    bs = block_size
    n = min(len(blocks), len(tokens) // bs)
    node, i = root, 0
    while i < n:
        key = block_tokens(tokens, i, bs)
        child = node.children.get(key)
        if child is None:
            node.children[key] = Node(tuple(tokens[i * bs:n * bs]), list(blocks[i:n]), node, {}, now)
            return list(blocks[i:n])
        k = edge_agreement(child, tokens, i, n, bs)
        if k < len(child.blocks):
            child = split(child, k, bs)
        node, i = child, i + k
    return []
