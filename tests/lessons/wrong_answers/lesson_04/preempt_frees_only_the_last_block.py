"""plan_step counts only the victim's last block as freed (as if preemption gave back the block being written)."""
from tinyserve.scheduler import SeqState, StepPlan, blocks_for

CAUGHT_BY = "plan_step"


def plan_step(running: list[SeqState], waiting: list[SeqState], free_blocks: int, token_budget: int,
              block_size: int, max_running: int = 1 << 30) -> StepPlan:
    plan = StepPlan()
    budget, free = token_budget, free_blocks
    alive = list(range(len(running)))   # running requests not preempted (yet), oldest first
    i = 0
    while i < len(alive):
        me = alive[i]
        s = running[me]
        if s.remaining == 1:
            n = min(1, budget)
        else:   # prefill chunk: keep one token of budget for each decode that comes after it
            reserve = sum(1 for j in alive[i + 1:] if running[j].remaining == 1)
            n = min(s.remaining, budget - reserve)
        if n <= 0:
            i += 1
            continue
        need = blocks_for(s.num_computed + n, block_size) - s.num_blocks
        while need > free and alive[-1] != me:       # push out the youngest other request
            victim = alive.pop()
            plan.preempt.append(victim)
            free += min(1, running[victim].freeable)
        if need > free:                                # it is the youngest itself: it waits for the others
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
