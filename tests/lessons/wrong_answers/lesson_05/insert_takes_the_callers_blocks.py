"""insert reports every block of the sequence as newly taken, even where the trie already caches those tokens."""
from tinyserve.prefix_cache import insert as _reference

CAUGHT_BY = "insert"


def insert(root, tokens, blocks, block_size, now):
    _reference(root, tokens, blocks, block_size, now)
    return list(blocks[:min(len(blocks), len(tokens) // block_size)])
