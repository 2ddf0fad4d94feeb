"""Lesson 4: all KV-block bookkeeping for sequences, in one place.

The scheduler decides *how many* tokens each sequence runs; the block manager makes sure its block table covers
them, and gives every block back when the sequence finishes or is preempted. Nothing else in the engine touches
the allocator, so lesson 5 (prefix caching) is a contained change here: `admit` may hand a new sequence blocks
that already hold its prompt prefix, `commit` may publish newly filled blocks, and `free` lets the cache keep them.
"""
from __future__ import annotations

from .paged import BlockAllocator
from .sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` positions: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free(self) -> int:
        """Blocks the scheduler may hand out this step."""
        return self.allocator.num_free

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks `seq` needs so that its table covers num_computed_tokens + num_new_tokens positions."""
        return max(0, blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def admit(self, seq: Sequence) -> None:
        """A waiting sequence becomes running. Without a prefix cache it starts from nothing: all its tokens
        (prompt + any output kept from before a preemption) are recomputed."""
        assert not seq.block_table, f"request {seq.request_id} is admitted while still holding blocks"
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table so the next `num_new_tokens` tokens have a slot. The scheduler has already
        checked the free count, so OutOfBlocks here is a bug, not a policy."""
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self.allocator.allocate())

    def commit(self, seq: Sequence) -> None:
        """Called after a forward has written seq's K/V up to num_computed_tokens (a prefix cache would publish
        the newly filled blocks here). Nothing to do without one."""

    def free(self, seq: Sequence) -> None:
        """Give back every block of a finished or preempted sequence (decref: a shared block lives on)."""
        for block in reversed(seq.block_table):   # reversed: the tail block, least likely to be shared, first
            self.allocator.decref(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0
