"""insert hangs a new node under the same key when an edge only partly agrees, replacing the old child (no split)."""
from tinyserve.prefix_cache import Node, block_tokens, edge_agreement

CAUGHT_BY = "insert"


def insert(root, tokens, blocks, block_size, now):
    bs = block_size
    n = min(len(blocks), len(tokens) // bs)
    node, i = root, 0
    node.last_access = now
    while i < n:
        key = block_tokens(tokens, i, bs)
        child = node.children.get(key)
        k = 0 if child is None else edge_agreement(child, tokens, i, n, bs)
        if child is None or k < len(child.blocks):
            node.children[key] = Node(tuple(tokens[i * bs:n * bs]), list(blocks[i:n]), node, {}, now)
            return list(blocks[i:n])
        child.last_access = now
        node, i = child, i + k
    return []
