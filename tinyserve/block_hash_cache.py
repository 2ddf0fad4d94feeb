"""Lesson 5, the other design: a flat hash table of full blocks, as vLLM-style engines cache prefixes.

Each full block of a sequence gets a *chain hash* over (the previous block's chain hash, this block's tokens), so
a block's hash names its whole prefix, not just its own tokens: block "d e f" after "a b c" and "d e f" after
"x y z" hash differently, because their K/V differ (attention saw different pasts). A lookup hashes the prompt
block by block and stops at the first hash the table does not hold. No tree: the chain of hashes *is* the path.

A 64-bit hash can collide, and a collision here would silently serve another prompt's K/V. So every entry keeps
its tokens and its parent's hash, and a hit is verified against them (vLLM offers SHA-256 for the same reason).

Same contract as PrefixCache (tinyserve/prefix_cache.py), so the engine and the lesson can swap one for the other:
match / insert / evict / allocate, one cache reference per cached block, evictable at refcount 1, the same
block-aligned matching and the same "the last prompt token always runs" rule.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

from .paged import BlockAllocator
from .cache_base import BlockCache, block_tokens


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The chain hash of every full block of tokens: h[i] = hash((h[i-1], tokens of block i)), h[-1] = None.

    A trailing partial block gets no hash (it is never cached). Python's hash of a tuple of ints is the same in
    every process (only str/bytes hashing is randomised), so these are stable keys.
    """
    return [h for h, _ in chain_hashes(tokens, block_size)]


def chain_hashes(tokens: Sequence[int], block_size: int) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(chain hash, tokens) of each full block, one at a time: a lookup stops hashing at its first miss."""
    parent = None
    for i in range(len(tokens) // block_size):
        blk = block_tokens(tokens, i, block_size)
        parent = hash((parent, blk))
        yield parent, blk


@dataclass(slots=True)
class Entry:
    block: int                 # the physical block holding these tokens' K/V
    parent: int | None         # chain hash of the block before (None for a sequence's first block)
    tokens: tuple[int, ...]    # this block's tokens: a hit is verified against them (and against `parent`)
    depth: int                 # index of the block in its sequence: on LRU ties the deepest goes first
    last_access: int


class BlockHashCache(BlockCache):
    """Prefix caching with a dict {chain hash: Entry}; the same contract as prefix_cache.PrefixCache (its memory
    accounting, allocate, num_free, users, ..., comes from their shared base, cache_base.BlockCache)."""

    def __init__(self, allocator: BlockAllocator):
        super().__init__(allocator)        # self.cached: the blocks of all entries
        self.table: dict[int, Entry] = {}

    def _lookup(self, tokens: Sequence[int]) -> list[tuple[int, Entry]]:
        """(hash, entry) of the cached full blocks of tokens, from the first block to the first miss."""
        found, parent = [], None
        for h, blk in chain_hashes(tokens, self.block_size):
            e = self.table.get(h)
            if e is None or e.tokens != blk or e.parent != parent:   # a miss, or a collision: not our prefix
                break
            found.append((h, e))
            parent = h
        return found

    def match(self, tokens: Sequence[int]) -> list[int]:
        """Blocks of the longest cached prefix (at most len(tokens) - 1 tokens, whole blocks), each incref'd."""
        self.clock += 1
        found = self._lookup(tokens[:len(tokens) - 1])
        for _, e in found:
            e.last_access = self.clock
            self.allocator.incref(e.block)
        self.stats.lookups += 1
        self.stats.query_tokens += len(tokens)
        self.stats.hit_tokens += len(found) * self.block_size
        return [e.block for _, e in found]

    def peek(self, tokens: Sequence[int]) -> list[int]:
        return [e.block for _, e in self._lookup(tokens[:len(tokens) - 1])]

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], holder_keeps_blocks: bool = False) -> int:
        """Publish computed full blocks (blocks[i] holds tokens[i*bs:(i+1)*bs]); returns how many were newly cached.
        A hash already present keeps its block (see PrefixCache.insert for holder_keeps_blocks)."""
        bs = self.block_size
        self.clock += 1
        adopted, parent = 0, None
        for i, (h, blk) in enumerate(chain_hashes(tokens[:len(blocks) * bs], bs)):
            e = self.table.get(h)
            if e is not None and (e.tokens != blk or e.parent != parent):
                break                      # a hash collision: leave the older entry alone, cache no further
            if e is None:
                self.table[h] = Entry(blocks[i], parent, blk, i, self.clock)
                self.allocator.incref(blocks[i])
                self.cached.add(blocks[i])
                adopted += 1
            elif e.block != blocks[i] and holder_keeps_blocks:
                e.last_access = self.clock
                break                      # someone else's copy: the running sequence keeps a root path
            else:
                e.last_access = self.clock
            parent = h
        self.stats.inserted_blocks += adopted
        return adopted

    def evict(self, num_blocks: int) -> int:
        """Free up to num_blocks cached blocks only the cache holds: least recently used first, and among blocks
        used at the same time the deepest first (the tail of a prompt before its head, like the trie's leaves)."""
        rc = self.allocator.refcount
        victims = sorted((e.last_access, -e.depth, h) for h, e in self.table.items() if rc[e.block] == 1)
        for _, _, h in victims[:num_blocks]:
            e = self.table.pop(h)          # the entry goes with the block: a reused block can never be hit
            self.cached.discard(e.block)
            freed = self.allocator.decref(e.block)
            assert freed, f"evicted block {e.block} was still referenced"
        n = min(num_blocks, len(victims))
        self.stats.evicted_blocks += n
        return n

    def check(self) -> None:
        rc, blocks = self.allocator.refcount, [e.block for e in self.table.values()]
        assert len(set(blocks)) == len(blocks), "a block is cached under two hashes"
        assert set(blocks) == self.cached, "the set of cached blocks disagrees with the table"
        for h, e in self.table.items():
            assert rc[e.block] >= 1, f"cached block {e.block} is free (refcount 0): a stale entry"
            assert hash((e.parent, e.tokens)) == h, "entry stored under the wrong hash"
            assert len(e.tokens) == self.block_size
