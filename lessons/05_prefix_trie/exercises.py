"""Lesson 5 exercises: the prefix trie over KV blocks (match, insert, LRU eviction) and the chain hashes of the
hash-table design it is compared with.

Replace each `raise NotImplementedError(...)` with your code, then run `make check-5`: it runs the checks in
tests/lessons/test_lesson_05.py against this file and tells you, exercise by exercise, what passes.
The reference answers live in tinyserve/prefix_cache.py and tinyserve/block_hash_cache.py: try first, compare after.

The trie (see tinyserve.prefix_cache.Node): every node has an edge `tokens` (a run of whole blocks:
len(tokens) == len(blocks) * bs), the physical KV `blocks` holding them (blocks[i] holds tokens[i*bs:(i+1)*bs]),
a `parent`, `children` keyed by each child's *first block* of tokens (a tuple of bs ints), and `last_access`.
The root has no tokens and no blocks. Matching is block-aligned: only whole blocks of a query take part.
"""
from __future__ import annotations

from typing import Sequence

from tinyserve.prefix_cache import Match, Node, iter_nodes, split  # noqa: F401  (the types and helpers you may use)


def match_prefix(root: Node, tokens: Sequence[int], block_size: int) -> Match:
    """Walk the trie along `tokens`, whole blocks at a time; return the longest cached prefix.

    Only full blocks of `tokens` take part (a trailing partial block never matches). The walk picks the child
    whose first block equals the next block of tokens, then compares the rest of that child's edge block by
    block; a mismatch inside an edge ends the match there. Nothing is modified.

    Returns Match(blocks, node, depth): the physical blocks of the matched prefix in order, the deepest node the
    walk reached (the root if nothing matched), and how many of that node's blocks matched (less than
    len(node.blocks) when the match ended inside its edge; 0 for the root).
    """
    raise NotImplementedError(
        "match_prefix: at each node the next whole block of the query is the key of at most one child. Compare the "
        "rest of that child's edge block by block: how many agree? Take that many of its blocks. When may the walk "
        "go on into the child's children, and when must it stop?")


def insert(root: Node, tokens: Sequence[int], blocks: Sequence[int], block_size: int, now: int) -> list[int]:
    """Add the full blocks of a sequence to the trie; return the blocks the trie newly took (in order).

    blocks[i] holds tokens[i*bs : (i+1)*bs]; only the first min(len(blocks), len(tokens) // bs) blocks are used.
    Where the trie already holds those tokens it keeps *its* block (the caller's copy is not taken: a token run is
    cached once); where the trie ends, the rest becomes one new leaf. An edge that only partly agrees is split.
    Every node on the path gets last_access = now.
    """
    raise NotImplementedError(
        "insert: walk like match_prefix. Where no child starts with the next block, everything left becomes one new"
        " leaf; where an edge agrees only partly, split() gives you a node ending exactly there. Which blocks does "
        "the trie take, and which nodes get last_access = now?")


def evict_lru(root: Node, num_blocks: int, refcount: Sequence[int], block_size: int) -> list[int]:
    """Remove up to `num_blocks` unreferenced blocks from the trie, least recently used leaves first.

    A block may go only when the cache alone holds it (refcount[block] == 1). Blocks leave from the *tail* of a
    leaf's edge (a prefix is worth more than its continuation: dropping a middle block would strand everything
    below it); a leaf whose edge empties is removed from its parent, and its parent may become a leaf in turn
    (never the root). Returns the evicted block ids in the order they were evicted.
    """
    raise NotImplementedError(
        "evict_lru: a heap of leaves ordered by last_access yields the least recently used one; take blocks off the"
        " tail of its edge while only the cache holds them. When an edge empties, the node leaves its parent, and "
        "the parent may just have become a leaf")


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chain hash of every full block of tokens: h[i] = hash((h[i-1], tokens of block i)), h[-1] = None.

    A trailing partial block gets no hash (it is never cached). Python's hash of a tuple of ints is the same in
    every process (only str/bytes hashing is randomised), so these are stable keys.
    """
    raise NotImplementedError(
        "block_hashes: parent = None; for each whole block, parent = hash((parent, tuple(block tokens))) "
        "and append it")
