"""Lesson 5: what every prefix cache shares — the blocks it holds a reference on, and the contract the engine uses.

Two designs find a cached prefix differently: a trie (prefix_cache.PrefixCache) and a flat table of chain hashes
(block_hash_cache.BlockHashCache). Both hold one reference on every block they cache, count a block only the cache
holds (refcount 1) as free memory, and evict such blocks when the pool runs dry; that accounting lives here, once.
A third cache, NoPrefixCache, never hits: it is what the engine uses with prefix caching off, so the block manager
runs one code path either way (a null object instead of `if cache is None` at every step).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from .paged import BlockAllocator


def block_tokens(tokens: Sequence[int], i: int, bs: int) -> tuple[int, ...]:
    """Block i of tokens, tokens[i*bs : (i+1)*bs], as a tuple: hashable, so it can key a dict."""
    return tuple(tokens[i * bs:(i + 1) * bs])


@dataclass(slots=True)
class CacheStats:
    """What one cache has seen, counted at every `match`: a request re-admitted after a preemption looks up (and
    mostly hits its own blocks) again, so under preemption this overstates the hit rate. The engine's prefix
    metrics (PrefixMetrics) count each request once, at its first admission: BlockManager.hits."""
    lookups: int = 0
    query_tokens: int = 0       # prompt tokens looked up
    hit_tokens: int = 0         # of those, served from the cache (their K/V were not recomputed)
    inserted_blocks: int = 0    # blocks the cache took over from sequences
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class BlockCache(ABC):
    """The set of blocks a cache holds one reference on, and the memory accounting that follows from it. The
    designs differ only in how they find a prefix (`peek`, `match`, `insert`) and which block goes first (`evict`).

    The engine's contract: `match` a new sequence's tokens (you get a reference on every returned block),
    `allocate` its other blocks through the cache (which evicts when the pool runs dry), `insert` its blocks when
    they are computed or when it leaves, and decref every block it holds when it leaves.
    """

    def __init__(self, allocator: BlockAllocator):
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.cached: set[int] = set()   # every block the cache holds (one cache reference each)
        self.clock = 0                  # a logical clock: deterministic LRU, no wall-time ties
        self.stats = CacheStats()

    # --- what each design implements -------------------------------------------------------------------------
    @abstractmethod
    def peek(self, tokens: Sequence[int]) -> list[int]:
        """The blocks `match` would return for `tokens`, without taking references or touching the LRU clock."""

    @abstractmethod
    def match(self, tokens: Sequence[int]) -> list[int]:
        """The blocks of the longest cached prefix of `tokens`, each incref'd for the caller. Whole blocks only, and
        at most len(tokens) - 1 tokens: the last token must still run through the model to give logits."""

    @abstractmethod
    def insert(self, tokens: Sequence[int], blocks: Sequence[int], holder_keeps_blocks: bool = False) -> int:
        """Publish computed full blocks (blocks[i] holds tokens[i*bs:(i+1)*bs]); the cache increfs each block it
        newly takes and returns how many. holder_keeps_blocks: the sequence keeps running, so it must keep holding
        a root path (see prefix_cache's module docstring)."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Give back up to `num_blocks` blocks only the cache holds (refcount 1); returns how many were freed."""

    @abstractmethod
    def check(self) -> None:
        """Assert the design's structural invariants (property tests call it after every operation)."""

    # --- shared accounting -----------------------------------------------------------------------------------
    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """How many tokens of a prompt `match` would serve (a peek)."""
        return len(self.peek(tokens)) * self.block_size

    def allocate(self) -> int:
        """A fresh block (refcount 1); evicts one cached block first if the pool is dry. Raises OutOfBlocks only
        when every block is in use by a sequence — exactly when an engine without a cache would run out too."""
        if self.allocator.num_free == 0:
            self.evict(1)
        return self.allocator.allocate()

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    @property
    def num_evictable(self) -> int:
        """Cached blocks that only the cache holds: free memory in all but name."""
        rc = self.allocator.refcount
        return sum(1 for b in self.cached if rc[b] == 1)

    @property
    def num_free(self) -> int:
        """What the scheduler may count on: free blocks plus blocks the cache would give back on demand."""
        return self.allocator.num_free + self.num_evictable

    def num_shared(self) -> int:
        """Cached blocks in use by two or more sequences right now (each stored once: the memory sharing saves)."""
        rc = self.allocator.refcount
        return sum(1 for b in self.cached if rc[b] >= 3)

    def users(self, block: int) -> int:
        """How many sequences hold `block` (its refcount minus the cache's own reference)."""
        return self.allocator.refcount[block] - (block in self.cached)

    def clear(self) -> int:
        """Drop every unreferenced block (e.g. to measure a cold start); returns how many were freed."""
        return self.evict(self.allocator.num_blocks)

    def num_freeable(self, blocks: Sequence[int]) -> int:
        """How many of a sequence's blocks would come back to the pool if it let go of them all: those no other
        sequence holds (a cached block only the cache still holds counts as free memory too)."""
        return sum(1 for b in blocks if self.users(b) == 1)


class NoPrefixCache(BlockCache):
    """Prefix caching off: a cache that never hits and never keeps a block. With it, a sequence starts from
    nothing, its blocks go straight back to the pool when it leaves, and num_free is the allocator's."""

    def peek(self, tokens: Sequence[int]) -> list[int]:
        return []

    def match(self, tokens: Sequence[int]) -> list[int]:
        self.stats.lookups += 1
        self.stats.query_tokens += len(tokens)
        return []

    def insert(self, tokens: Sequence[int], blocks: Sequence[int], holder_keeps_blocks: bool = False) -> int:
        return 0

    def evict(self, num_blocks: int) -> int:
        return 0

    def check(self) -> None:
        assert not self.cached, "a cache that never hits holds no block"

    def num_freeable(self, blocks: Sequence[int]) -> int:
        return len(blocks)   # nothing is shared: every block comes back (and no need to look at each)
