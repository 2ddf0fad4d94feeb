"""BlockAllocator: the free list and the reference counts never disagree, whatever the order of operations.

Hypothesis drives random sequences of allocate / incref / decref (a model of the engine and the prefix cache
sharing blocks) and checks the invariants after every step against a plain dict of what we handed out.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.paged import BlockAllocator, OutOfBlocks

# an operation: ("alloc",), or ("incref" | "decref", index into the blocks currently held, modulo their number)
ops = st.lists(st.one_of(st.just(("alloc", 0)),
                         st.tuples(st.sampled_from(["incref", "decref"]), st.integers(0, 1000))), max_size=200)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 12), operations=ops)
def test_random_operations_keep_invariants(num_blocks, operations):
    alloc = BlockAllocator(num_blocks, block_size=4)
    held: dict[int, int] = {}                       # block -> how many owners we think it has
    for op, i in operations:
        if op == "alloc":
            if len(held) == num_blocks:
                with pytest.raises(OutOfBlocks):
                    alloc.allocate()
            else:
                block = alloc.allocate()
                assert block not in held, f"block {block} handed out while still referenced"
                held[block] = 1
        elif held:
            block = sorted(held)[i % len(held)]
            if op == "incref":
                alloc.incref(block)
                held[block] += 1
            else:
                freed = alloc.decref(block)
                held[block] -= 1
                assert freed == (held[block] == 0)
                if not held[block]:
                    del held[block]
        alloc.check()                                # free <=> refcount 0, never negative, no duplicates
        assert all(rc >= 0 for rc in alloc.refcount)
        assert {b: rc for b, rc in enumerate(alloc.refcount) if rc} == held
        assert alloc.num_used == len(held) and alloc.num_free == num_blocks - len(held)
    # release everything: every block is back on the free list
    for block, count in list(held.items()):
        for _ in range(count):
            alloc.decref(block)
    alloc.check()
    assert alloc.num_free == num_blocks and not any(alloc.refcount)
    assert sorted(alloc.allocate() for _ in range(num_blocks)) == list(range(num_blocks))


def test_freed_block_is_reused_last():
    # FIFO free list: a just-freed block goes to the back, so a stale cache entry pointing at it survives
    # as long as possible (and the prefix cache of lesson 5 gets a chance to revive it)
    alloc = BlockAllocator(3, block_size=2)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.decref(a)
    assert alloc.allocate() == 2 and alloc.allocate() == a
    with pytest.raises(OutOfBlocks, match="3 KV blocks"):
        alloc.allocate()
    assert b == 1


def test_misuse_is_caught():
    alloc = BlockAllocator(2, block_size=2)
    with pytest.raises(AssertionError, match="incref on free block"):
        alloc.incref(0)
    with pytest.raises(AssertionError, match="never go negative"):
        alloc.decref(1)
    with pytest.raises(ValueError, match="num_blocks must be an integer >= 1"):
        BlockAllocator(0, block_size=16)
    with pytest.raises(ValueError, match="block_size must be an integer >= 1"):
        BlockAllocator(4, block_size=0)
