"""Lesson 4: paged KV memory — a pool of fixed-size blocks, a block allocator, and per-sequence block tables.

Contiguous caches reserve max_seq_len positions per request up front; most of that memory is never used.
Paging (as in an OS) hands out small fixed-size blocks on demand, and a block table maps a sequence's logical
block i to a physical block anywhere in the pool. Blocks carry reference counts so that lesson 5 can share one
physical block between many sequences (a shared prompt prefix) and free it only when the last user is gone.
"""
from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """The pool has no free block left; the scheduler answers this by preempting a request."""


class BlockAllocator:
    """Free list + reference counts over `num_blocks` physical blocks (ids 0 .. num_blocks-1).

    Invariants (checked by `check()` and by property tests): a block is on the free list iff its refcount is 0;
    refcounts are never negative; every block is either free or referenced.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # FIFO: a freed block is reused as late as possible

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        """A fresh block with refcount 1. Raises OutOfBlocks when none is free."""
        if not self._free:
            raise OutOfBlocks(f"all {self.num_blocks} KV blocks are in use")
        block = self._free.popleft()
        assert self.refcount[block] == 0, f"block {block} was on the free list with refcount {self.refcount[block]}"
        self.refcount[block] = 1
        return block

    def incref(self, block: int) -> None:
        """Another owner (a sequence or the prefix cache) now holds `block`."""
        assert self.refcount[block] > 0, f"incref on free block {block}"
        self.refcount[block] += 1

    def decref(self, block: int) -> bool:
        """One owner lets go of `block`; returns True when that freed it."""
        assert self.refcount[block] > 0, f"decref on free block {block}: refcounts must never go negative"
        self.refcount[block] -= 1
        if self.refcount[block] == 0:
            self._free.append(block)
            return True
        return False

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self.refcount):
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc} but {'on' if b in free else 'off'} free list"
