"""plan_step admits a later waiting request when the head of the queue does not fit (not FCFS)."""
from tinyserve.scheduler import StepPlan, blocks_for

CAUGHT_BY = "plan_step"


def plan_step(running, waiting, free_blocks, token_budget, block_size, max_running=1 << 30):
    plan = StepPlan()
    budget, free = token_budget, free_blocks
    alive = list(range(len(running)))
    i = 0
    while i < len(alive):
        me = alive[i]
        s = running[me]
        if s.remaining == 1:
            n = min(1, budget)
        else:
            reserve = sum(1 for j in alive[i + 1:] if running[j].remaining == 1)
            n = min(s.remaining, budget - reserve)
        if n <= 0:
            i += 1
            continue
        need = blocks_for(s.num_computed + n, block_size) - s.num_blocks
        while need > free and alive[-1] != me:
            victim = alive.pop()
            plan.preempt.append(victim)
            free += running[victim].freeable
        if need > free:
            alive.pop()
            plan.preempt.append(me)
            free += s.freeable
            break
        free -= need
        budget -= n
        plan.run.append((me, n))
        i += 1
    if plan.preempt:
        return plan
    for w, s in enumerate(waiting):
        if len(alive) + len(plan.admit) >= max_running or budget <= 0:
            break
        n = min(s.remaining, budget)
        need = blocks_for(s.num_computed + n, block_size) - s.num_blocks
        if need > free:
            continue                          # the mistake: try the next one
        free -= need
        budget -= n
        plan.admit.append((w, n))
    return plan
