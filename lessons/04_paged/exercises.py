"""Lesson 4 exercises: the block allocator, the block-table lookup (slot mapping), the scheduler step.

Replace each `raise NotImplementedError(...)`, then run `make check-4`: it runs tests/lessons/test_lesson_04.py
against this file and tells you, exercise by exercise, what passes. The reference answers are in
tinyserve/paged.py (BlockAllocator, slot_mapping) and tinyserve/scheduler.py (plan_step): try first, peek later.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

import numpy as np

# The pieces you may build on: the allocator's error, the scheduler's small types and the ceil-division helper.
from tinyserve.paged import OutOfBlocks  # noqa: F401
from tinyserve.scheduler import SeqState, StepPlan, blocks_for  # noqa: F401


class BlockAllocator:
    """Free list + reference counts over `num_blocks` physical blocks (ids 0 .. num_blocks-1).

    Invariants (checked by `check()` and by property tests): a block is on the free list iff its refcount is 0;
    refcounts are never negative; every block is either free or referenced.
    """

    def __init__(self, num_blocks: int, block_size: int):
        # given: the state. Implement the methods below on top of it.
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # FIFO: a freed block is reused as late as possible

    @property
    def num_free(self) -> int:
        raise NotImplementedError("num_free: how many blocks are on the free list?")

    @property
    def num_used(self) -> int:
        raise NotImplementedError("num_used: every block that is not free")

    def allocate(self) -> int:
        """A fresh block with refcount 1. Raises OutOfBlocks when none is free."""
        raise NotImplementedError(
            "allocate: which end of the FIFO free list do you take from, what if it is empty, and what is the "
            "refcount of a block only you hold?")

    def incref(self, block: int) -> None:
        """Another owner (a sequence or the prefix cache) now holds `block`."""
        raise NotImplementedError("incref: a block that is in use gains one owner (assert it is in use)")

    def decref(self, block: int) -> bool:
        """One owner lets go of `block`; returns True when that freed it."""
        raise NotImplementedError(
            "decref: a refcount never goes below zero (assert it). When the last owner lets go, where does the "
            "block go so that it is reused as late as possible, and what do you return?")

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b, rc in enumerate(self.refcount):
            assert rc >= 0, f"block {b} has negative refcount {rc}"
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc} but {'on' if b in free else 'off'} free list"


def slot_mapping(block_table: Sequence[int], start: int, count: int, block_size: int) -> np.ndarray:
    """Flat pool slots of positions start .. start+count-1 of one sequence: [count] int64.

    slot = block_table[p // bs] * bs + p % bs — the row where position p's K/V lives in a pool layer
    viewed as [num_blocks * bs, K, H].
    """
    raise NotImplementedError(
        "slot_mapping: for each position p, which entry of the block table holds it, and where inside that block "
        "does it sit? Before answering, make sure the table has allocated (no -1) every block these positions "
        "reach; negative start or count is a ValueError too")


def plan_step(running: list[SeqState], waiting: list[SeqState], free_blocks: int, token_budget: int,
              block_size: int, max_running: int = 1 << 30) -> StepPlan:
    """Decide one engine step. `running` and `waiting` are in arrival order (oldest first).

    Guarantees: at most `token_budget` tokens run; the blocks the chunks need never exceed `free_blocks` plus the
    blocks of the preempted requests; no admission in a step that preempts; waiting requests are admitted as a
    prefix of the queue (FCFS).
    """
    raise NotImplementedError(
        "plan_step: two passes. (1) Running requests, oldest first: how many tokens may each run (a decode needs 1;"
        " a prefill chunk leaves one token of budget for every decode *after* it), and how many new blocks does "
        "that take? If they are not free, who gives blocks back, youngest first (SeqState.freeable says how many), "
        "and what if the request itself is the youngest? (2) Only if nobody was preempted: admit waiting requests in order while the budget, the "
        "blocks and max_running allow; stop at the first that does not fit")
