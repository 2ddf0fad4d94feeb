"""The scheduler step (a pure function) over whole simulated workloads.

No model: a "forward" just advances num_computed and, when a chunk reaches the end of a sequence, appends a token.
`simulate` checks the plan's guarantees after every step (budget, free blocks, FCFS, no admission while
preempting) and that every request finishes with every block back in the pool, without livelock. The hand-made
cases of plan_step live in tests/lessons/test_lesson_04.py (they also check the learner's version), which reuses
`simulate`.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from tinyserve.scheduler import SeqState, blocks_for, plan_step


# --- a simulated engine: the scheduler's guarantees over whole workloads ------------------------------------------

WORKLOADS = (st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=12),
             st.integers(1, 6), st.integers(1, 64), st.integers(0, 30))


def simulate(plan_step, requests: list[tuple[int, int]], block_size: int, budget: int, spare: int) -> int:
    """Run a workload of (prompt length, output length) requests through `plan_step`; return the number of
    preemptions. The pool is just big enough for the largest request plus `spare` blocks, so small pools force
    preemption."""
    need = [blocks_for(p + o - 1, block_size) for p, o in requests]
    free = max(need) + spare
    total = free
    prompt = [p for p, _ in requests]
    out_len = [o for _, o in requests]
    produced = [0] * len(requests)
    computed = [0] * len(requests)
    blocks = [0] * len(requests)
    running: list[int] = []
    waiting = list(range(len(requests)))
    preemptions = 0
    for _ in range(10_000):
        if not running and not waiting:
            break
        state = lambda r: SeqState(prompt[r] + produced[r], computed[r], blocks[r])  # noqa: E731
        plan = plan_step([state(r) for r in running], [state(r) for r in waiting], free, budget, block_size)
        assert plan.num_tokens <= budget
        assert [w for w, _ in plan.admit] == list(range(len(plan.admit)))
        assert not (plan.preempt and plan.admit)
        batch = [(running[i], n) for i, n in plan.run]
        preemptions += len(plan.preempt)
        for i in plan.preempt:
            r = running[i]
            free += blocks[r]
            blocks[r] = computed[r] = 0
        for i in plan.preempt:                                 # youngest first -> oldest ends up in front
            waiting.insert(0, running[i])
        running = [r for i, r in enumerate(running) if i not in plan.preempt]
        for w, n in plan.admit:
            batch.append((waiting[w], n))
        admitted = [waiting[w] for w, _ in plan.admit]
        waiting = waiting[len(plan.admit):]
        running += admitted
        assert batch or not running, "a step with running requests must make progress"
        for r, n in batch:
            grow = blocks_for(computed[r] + n, block_size) - blocks[r]
            free -= max(grow, 0)
            blocks[r] += max(grow, 0)
            assert free >= 0, "the plan handed out more blocks than were free"
            computed[r] += n
            if computed[r] == prompt[r] + produced[r]:          # the chunk reached the end: sample
                produced[r] += 1
                if produced[r] == out_len[r]:
                    running.remove(r)
                    free += blocks[r]
                    blocks[r] = 0
    else:
        raise AssertionError("the workload did not finish: livelock")
    assert produced == out_len
    assert free == total, "blocks leaked"
    assert np.all(np.array(blocks) == 0)
    return preemptions


@settings(max_examples=60, deadline=None)
@given(*WORKLOADS)
def test_simulated_workload_finishes_without_leaks(requests, block_size, budget, spare):
    simulate(plan_step, requests, block_size, budget, spare)


def test_simulation_does_preempt_on_a_small_pool():
    assert simulate(plan_step, [(4, 30)] * 6, block_size=4, budget=64, spare=2) > 0
