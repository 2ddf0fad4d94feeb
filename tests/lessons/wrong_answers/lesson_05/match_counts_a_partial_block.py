"""match_prefix lets a trailing partial block of the query match (ceil instead of floor of len / bs)."""
from tinyserve.prefix_cache import Match

CAUGHT_BY = "match_prefix"


def match_prefix(root, tokens, block_size):
    bs = block_size
    node, depth, blocks, i = root, 0, [], 0
    while i * bs < len(tokens):
        part = tuple(tokens[i * bs:(i + 1) * bs])
        child = next((c for key, c in node.children.items() if key[:len(part)] == part), None)
        if child is None:
            break
        k = 0
        while k < len(child.blocks) and (i + k) * bs < len(tokens):
            q = tuple(tokens[(i + k) * bs:(i + k + 1) * bs])
            if child.tokens[k * bs:k * bs + len(q)] != q:
                break
            k += 1
        blocks += child.blocks[:k]
        i += k
        node, depth = child, k
        if k < len(child.blocks):
            break
    return Match(blocks, node, depth)
