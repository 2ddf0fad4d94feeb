"""match_prefix updates last_access on the nodes it walks (a lookup must not modify the trie: the cache does that)."""
from tinyserve.prefix_cache import match_prefix as _reference

CAUGHT_BY = "match_prefix"


def match_prefix(root, tokens, block_size):
    m = _reference(root, tokens, block_size)
    node = m.node
    while node is not None:
        node.last_access += 1
        node = node.parent
    return m
