"""plan_step lets a prefill chunk take the whole budget, so the decodes behind it starve."""
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
            reserve = 0
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
            break
        free -= need
        budget -= n
        plan.admit.append((w, n))
    return plan
