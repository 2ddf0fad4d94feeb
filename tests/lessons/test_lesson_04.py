"""Lesson 4 self-checks: the block allocator, the block-table lookup (slot mapping), the scheduler step.

`make check-4` runs these against lessons/04_paged/exercises.py; `make test` runs them against tinyserve.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.lessons.impl import CHECKS, load_impl
from tests.test_scheduler import WORKLOADS, simulate
from tinyserve.paged import OutOfBlocks
from tinyserve.scheduler import SeqState, blocks_for

REFERENCE = {
    "BlockAllocator": "tinyserve.paged:BlockAllocator",
    "slot_mapping": "tinyserve.paged:slot_mapping",
    "plan_step": "tinyserve.scheduler:plan_step",
}
impl = load_impl(4, REFERENCE)


# --- the allocator --------------------------------------------------------------------------------------------

@pytest.mark.exercise("BlockAllocator")
def test_allocate_hands_out_every_block_once_then_runs_out():
    alloc = impl.BlockAllocator(4, 16)
    got = [alloc.allocate() for _ in range(4)]
    assert sorted(got) == [0, 1, 2, 3], "each physical block exactly once"
    assert alloc.num_free == 0 and alloc.num_used == 4, "after 4 allocations of 4 blocks: 0 free, 4 used"
    assert all(alloc.refcount[b] == 1 for b in got), "a freshly allocated block has exactly one owner"
    with pytest.raises(OutOfBlocks):
        alloc.allocate()
    alloc.check()


@pytest.mark.exercise("BlockAllocator")
def test_refcounts_a_shared_block_is_freed_by_its_last_owner():
    alloc = impl.BlockAllocator(3, 4)
    b = alloc.allocate()
    alloc.incref(b)                         # a second sequence (or the prefix cache) shares it
    assert alloc.refcount[b] == 2
    assert (alloc.num_used, alloc.num_free) == (1, 2), (
        f"one block shared by two owners is still one block in use: num_used {alloc.num_used} (want 1), "
        f"num_free {alloc.num_free} (want 2); count blocks, not references")
    assert alloc.decref(b) is False         # one owner left: still in use
    assert alloc.num_free == 2
    assert alloc.decref(b) is True          # the last owner: back on the free list
    assert alloc.num_free == 3 and alloc.refcount[b] == 0
    alloc.check()
    with pytest.raises(AssertionError):     # refcounts never go negative
        alloc.decref(b)


@pytest.mark.exercise("BlockAllocator")
def test_incref_refuses_a_free_block():
    alloc = impl.BlockAllocator(2, 4)
    b = alloc.allocate()
    alloc.decref(b)                          # b is free again
    with pytest.raises(AssertionError):
        alloc.incref(b)                      # nobody may take a second reference on a block nobody holds
        pytest.fail(f"incref({b}) on a free block must fail (assert): the block is still on the free list, so "
                    f"allocate() would hand it out again while someone thinks they hold it")


@pytest.mark.exercise("BlockAllocator")
def test_freed_blocks_are_reused_last():
    alloc = impl.BlockAllocator(4, 4)
    a, b = alloc.allocate(), alloc.allocate()
    alloc.decref(a)
    assert [alloc.allocate(), alloc.allocate(), alloc.allocate()] == [2, 3, a], "FIFO free list"


@pytest.mark.exercise("BlockAllocator")
@settings(CHECKS, max_examples=40)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "incref", "decref"]), st.integers(0, 1000)), max_size=60))
def test_random_operations_keep_the_invariants(ops):
    alloc = impl.BlockAllocator(5, 2)
    owners: dict[int, int] = {}                        # the truth: block -> number of owners
    for op, pick in ops:
        if op == "alloc":
            if len(owners) == 5:
                with pytest.raises(OutOfBlocks):
                    alloc.allocate()
            else:
                b = alloc.allocate()
                assert b not in owners, f"block {b} handed out while in use"
                owners[b] = 1
        elif owners:
            b = sorted(owners)[pick % len(owners)]
            if op == "incref":
                alloc.incref(b)
                owners[b] += 1
            else:
                owners[b] -= 1
                assert alloc.decref(b) is (owners[b] == 0)
                if not owners[b]:
                    del owners[b]
        assert alloc.num_free == 5 - len(owners)
        assert [alloc.refcount[b] for b in range(5)] == [owners.get(b, 0) for b in range(5)]
        alloc.check()


# --- the block-table lookup -------------------------------------------------------------------------------------

@pytest.mark.exercise("slot_mapping")
def test_slot_mapping_walks_the_block_table():
    # positions 3..8 with bs = 4: the last slot of block 7, then all of block 2, then the first of block 5
    slots = impl.slot_mapping([7, 2, 5], 3, 6, 4)
    assert slots.tolist() == [31, 8, 9, 10, 11, 20], "slot = table[p // 4] * 4 + p % 4 for p = 3..8"
    assert slots.dtype == np.int64, f"slots are int64 (they index a large pool), got {slots.dtype}"
    assert impl.slot_mapping([7, 2, 5], 9, 1, 4).tolist() == [21]          # decode: one position
    assert impl.slot_mapping(np.array([3, -1], np.int32), 0, 2, 4).tolist() == [12, 13]
    assert impl.slot_mapping([1], 0, 0, 4).tolist() == []


@pytest.mark.exercise("slot_mapping")
def test_slot_mapping_addresses_the_right_rows_of_the_pool():
    bs, K, H = 4, 2, 3
    pool = np.zeros((6, bs, K, H), np.float32)                             # [num_blocks, bs, K, H]
    table = [4, 0, 5]
    kv = np.arange(10 * K * H, dtype=np.float32).reshape(10, K, H) + 1     # positions 0..9 of one sequence
    pool.reshape(-1, K, H)[impl.slot_mapping(table, 0, 10, bs)] = kv
    np.testing.assert_array_equal(pool[table].reshape(-1, K, H)[:10], kv)  # reading the blocks in table order
    assert not pool[[1, 2, 3]].any(), "nothing written outside the sequence's blocks"


@pytest.mark.exercise("slot_mapping")
def test_slot_mapping_refuses_unallocated_positions():
    with pytest.raises(ValueError):
        impl.slot_mapping([7, 2], 6, 3, 4)          # position 8 needs a third block
    with pytest.raises(ValueError):
        impl.slot_mapping([7, -1], 3, 2, 4)         # position 4 falls in an unallocated (-1) entry
    with pytest.raises(ValueError):
        impl.slot_mapping([7], -1, 1, 4)


# --- the scheduler step -----------------------------------------------------------------------------------------

def decoding(num_tokens: int, bs: int = 4) -> SeqState:
    return SeqState(num_tokens, num_tokens - 1, blocks_for(num_tokens - 1, bs))


@pytest.mark.exercise("plan_step")
def test_all_decodes_and_a_new_prompt_fit():
    plan = impl.plan_step([decoding(10), decoding(7)], [SeqState(6, 0, 0)], free_blocks=10, token_budget=100,
                          block_size=4)
    assert (plan.run, plan.admit, plan.preempt) == ([(0, 1), (1, 1)], [(0, 6)], []), \
        "room for everything: both decodes run one token, the new 6-token prompt is admitted whole, nobody preempted"


@pytest.mark.exercise("plan_step")
def test_a_long_prefill_is_chunked_and_leaves_budget_for_younger_decodes():
    # the oldest request is mid-prefill with 100 tokens to go; two younger ones are decoding
    plan = impl.plan_step([SeqState(120, 20, 5), decoding(9), decoding(5)], [], free_blocks=100, token_budget=16,
                          block_size=4)
    assert plan.run == [(0, 14), (1, 1), (2, 1)]   # 14 = budget 16 - one token kept for each decode behind it


@pytest.mark.exercise("plan_step")
def test_zero_budget_left_skips_instead_of_running_empty_chunks():
    plan = impl.plan_step([decoding(5), decoding(6), decoding(7)], [], free_blocks=10, token_budget=2, block_size=4)
    assert plan.run == [(0, 1), (1, 1)], f"a budget of 2 runs two decodes; the third gets 0 tokens and is skipped: {plan.run}"


@pytest.mark.exercise("plan_step")
def test_waiting_requests_are_admitted_first_come_first_served():
    waiting = [SeqState(40, 0, 0), SeqState(3, 0, 0)]
    # the head needs 10 blocks for its whole prompt; only 8 are free: the small one must not overtake it
    assert impl.plan_step([], waiting, free_blocks=8, token_budget=100, block_size=4).admit == []
    # with a smaller budget the head's first chunk (5 blocks) fits: admitted with a partial prefill
    assert impl.plan_step([], waiting, free_blocks=8, token_budget=20, block_size=4).admit == [(0, 20)]
    # max_running caps how many run at once
    plan = impl.plan_step([decoding(5)], [SeqState(2, 0, 0)] * 3, free_blocks=50, token_budget=50, block_size=4,
                          max_running=3)
    assert plan.admit == [(0, 2), (1, 2)]


@pytest.mark.exercise("plan_step")
def test_out_of_blocks_preempts_the_youngest_and_admits_nobody():
    # all three need a new block for their next token (8 tokens computed = 2 full blocks of 4); none is free
    running = [SeqState(9, 8, 2), SeqState(9, 8, 2), SeqState(9, 8, 2)]
    plan = impl.plan_step(running, [SeqState(1, 0, 0)], free_blocks=0, token_budget=100, block_size=4)
    assert plan.preempt == [2]               # the youngest gives back 2 blocks: enough for the two older ones
    assert plan.run == [(0, 1), (1, 1)]
    assert plan.admit == []                  # never admit in a step that had to preempt
    # the youngest preempts itself when nobody younger is left to push out
    plan = impl.plan_step([SeqState(9, 8, 2), SeqState(5, 4, 1)], [], free_blocks=0, token_budget=100, block_size=4)
    assert (plan.preempt, plan.run) == ([1], [(0, 1)])


@pytest.mark.exercise("plan_step")
def test_the_youngest_preempts_itself_rather_than_skipping_its_turn():
    # request 0 decodes inside its last block (6 tokens, 5 computed: block 2 has room); request 1 needs a new block
    # for its next token and nothing is free. Nobody younger than 1 can be pushed out: 1 preempts ITSELF (gives
    # back its 2 blocks and waits at the front of the queue). Skipping its turn while keeping its blocks would hold
    # memory it cannot use, and it could wait forever behind requests that keep growing.
    plan = impl.plan_step([SeqState(6, 5, 2), SeqState(9, 8, 2)], [SeqState(3, 0, 0)], free_blocks=0,
                          token_budget=100, block_size=4)
    assert plan.preempt == [1], (
        f"preempt = {plan.preempt}: request 1 cannot get the block it needs and is the youngest, so it must be "
        f"preempted (give back its blocks), not skipped while holding them")
    assert plan.run == [(0, 1)], f"request 0 has room for its next token and should run: run = {plan.run}"
    assert plan.admit == [], "no admission in a step that preempted"


@pytest.mark.exercise("plan_step")
def test_no_admission_in_a_step_that_preempted_even_if_blocks_are_left():
    # the youngest gives back 3 blocks; the oldest needs only 1 of them. 2 are left over and a 1-token request
    # waits: it still must not be admitted in this step (it would race the preempted request for the blocks)
    plan = impl.plan_step([SeqState(9, 8, 2), SeqState(10, 9, 3)], [SeqState(1, 0, 0)], free_blocks=0,
                          token_budget=100, block_size=4)
    assert plan.preempt == [1] and plan.run == [(0, 1)], f"preempt {plan.preempt}, run {plan.run}"
    assert plan.admit == [], f"admitted {plan.admit} in a step that preempted: admit only when nobody was preempted"


@pytest.mark.exercise("plan_step")
def test_the_decode_reserve_counts_only_decodes_after_the_prefill():
    # [decode, prefill of 100, decode], budget 16: the first decode takes 1 token; the prefill keeps 1 for the decode
    # behind it (the one before it has already taken its token): 16 - 1 - 1 = 14
    plan = impl.plan_step([decoding(9), SeqState(120, 20, 5), decoding(5)], [], free_blocks=100, token_budget=16,
                          block_size=4)
    assert plan.run == [(0, 1), (1, 14), (2, 1)], (
        f"run = {plan.run}: the prefill chunk should be 14 = 16 - 1 (taken by the decode before it) - 1 (kept for "
        f"the decode after it); a reserve for decodes *before* it counts them twice and wastes budget")


@pytest.mark.exercise("plan_step")
@settings(CHECKS, max_examples=25)
@given(*WORKLOADS)
def test_whole_workloads_finish_without_leaks_or_livelock(requests, block_size, budget, spare):
    simulate(impl.plan_step, requests, block_size, budget, spare)


@pytest.mark.exercise("plan_step")
def test_a_prefill_without_budget_is_skipped_and_the_decodes_behind_it_still_run():
    # budget 2, a prefill then two decodes: the prefill keeps 1 token for each decode behind it, so it gets 0 and is
    # skipped; the loop must go on to the decodes (not stop, not jump over the next one)
    plan = impl.plan_step([SeqState(120, 20, 5), decoding(9), decoding(5)], [], free_blocks=100, token_budget=2,
                          block_size=4)
    assert plan.run == [(1, 1), (2, 1)], (
        f"run = {plan.run}: the prefill gets 2 - 2 (kept for the two decodes behind it) = 0 tokens and is skipped, "
        f"but both decodes behind it still run one token each; skipping a request moves on to the very next one")


@pytest.mark.exercise("plan_step")
def test_exactly_enough_free_blocks_preempts_nobody():
    # request 0 needs one new block for its next token and exactly one is free; request 1 decodes inside its block
    plan = impl.plan_step([SeqState(9, 8, 2), SeqState(6, 5, 2)], [], free_blocks=1, token_budget=100, block_size=4)
    assert (plan.preempt, plan.run) == ([], [(0, 1), (1, 1)]), (
        f"preempt {plan.preempt}, run {plan.run}: 1 block needed and 1 free is enough (need > free preempts, "
        f"need == free does not)")


@pytest.mark.exercise("plan_step")
def test_a_middle_request_short_of_blocks_pushes_out_the_youngest_not_itself():
    # 0 decodes inside its block, 1 needs a new block, 2 (the youngest) holds 2 blocks; nothing is free: 2 goes
    plan = impl.plan_step([SeqState(6, 5, 2), SeqState(9, 8, 2), SeqState(9, 8, 2)], [], free_blocks=0,
                          token_budget=100, block_size=4)
    assert (plan.preempt, plan.run) == ([2], [(0, 1), (1, 1)]), (
        f"preempt {plan.preempt}, run {plan.run}: request 1 is short of a block and a younger one (2) exists: "
        f"preempt the youngest (alive[-1]), and request 1 runs with the blocks it gave back")


def _chunks_by_the_budget_rule(running: list[SeqState], budget: int) -> list[tuple[int, int]]:
    """The docstring's budget rule, with blocks to spare: a decode takes 1 token, a prefill chunk the rest of the budget
    minus one token for every decode after it; a request with 0 tokens is skipped."""
    run = []
    for i, s in enumerate(running):
        later = sum(1 for r in running[i + 1:] if r.remaining == 1)
        n = min(1, budget) if s.remaining == 1 else min(s.remaining, budget - later)
        if n > 0:
            run.append((i, n))
            budget -= n
    return run


@pytest.mark.exercise("plan_step")
@settings(CHECKS, max_examples=80)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from([1, 1, 2, 5, 13])), min_size=1, max_size=6),
       st.integers(0, 40), st.sampled_from([1, 3, 4, 16]))
def test_chunks_follow_the_budget_rule_and_exactly_enough_blocks_preempt_nobody(reqs, budget, bs):
    # decodes and prefills mixed in any order, any budget (also 0 and less than the decodes), and exactly as many free
    # blocks as the chunks need: nobody is preempted, every chunk follows the budget rule
    running = [SeqState(c + rest, c, blocks_for(c, bs)) for c, rest in reqs]   # rest 1: decoding, else prefilling
    want = _chunks_by_the_budget_rule(running, budget)
    free = sum(blocks_for(running[i].num_computed + n, bs) - running[i].num_blocks for i, n in want)
    plan = impl.plan_step(running, [], free_blocks=free, token_budget=budget, block_size=bs)
    assert plan.preempt == [], (
        f"preempted {plan.preempt} with exactly the {free} free blocks the chunks need (block size {bs}): a chunk "
        f"preempts only when it needs MORE blocks than are free")
    assert plan.run == want, (
        f"budget {budget}, requests (tokens, computed) {[(s.num_tokens, s.num_computed) for s in running]}: run should "
        f"be {want} (a decode takes 1 token, a prefill the budget left minus one per decode after it, a request "
        f"that gets 0 tokens is skipped and the next one still gets its turn), got {plan.run}")


@pytest.mark.exercise("plan_step")
def test_a_waiting_request_that_already_holds_blocks_needs_only_the_rest():
    # a waiting request with 4 of its 9 tokens already computed into 2 blocks (a prefix-cache hit, lesson 5): its
    # 5 remaining tokens reach 3 blocks of 4, so it needs 3 - 2 = 1 new block, and 1 is free
    plan = impl.plan_step([], [SeqState(9, 4, 2)], free_blocks=1, token_budget=100, block_size=4)
    assert plan.admit == [(0, 5)], (
        f"admit = {plan.admit}: the request holds 2 blocks already and its chunk reaches 3, so it needs "
        f"blocks_for(4 + 5, 4) - 2 = 1 new block, which is free: admit its 5 tokens")


@pytest.mark.exercise("plan_step")
@pytest.mark.parametrize("freeable", [0, 1, 3])
def test_a_victim_gives_back_only_the_blocks_nobody_else_shares(freeable):
    # the youngest holds 5 blocks, of which 5 - freeable are a prefix another request also uses (lesson 5): preempting
    # it frees only `freeable`. Requests 0 and 1 each need one new block for their next token; nothing is free.
    running = [SeqState(9, 8, 2), SeqState(9, 8, 2), SeqState(21, 20, 5, num_freeable=freeable)]
    plan = impl.plan_step(running, [], free_blocks=0, token_budget=100, block_size=4)
    # freeable >= 2: both older ones get a block. Fewer: request 0 still lacks blocks, so request 1 goes too (as the
    # youngest left when request 0 looks, or preempting itself): request 0 runs on what 1 and 2 gave back
    preempt, runs = ([2], [(0, 1), (1, 1)]) if freeable >= 2 else ([2, 1], [(0, 1)])
    assert (plan.preempt, plan.run) == (preempt, runs), (
        f"the youngest gives back {freeable} of its 5 blocks (the rest are shared and stay held): expected preempt "
        f"{preempt}, run {runs}; got preempt {plan.preempt}, run {plan.run}. A victim frees SeqState.freeable "
        f"blocks, not num_blocks")
