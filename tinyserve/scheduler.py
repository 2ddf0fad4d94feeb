"""Lesson 4: the scheduler step — who runs how many tokens, who gets in, who is pushed out.

Continuous batching decides this every step (not once per batch): a finished request's slot is refilled at
once by a waiting one. The decision is a pure function of a few numbers per request, so it can be read, tested
and drawn without a model:

  1. Running requests, oldest first, each get their next chunk: 1 token when decoding, up to the rest of the
     per-step token budget when prefilling. A prefill chunk leaves one token of budget for every decoding
     request behind it, so a long prompt is spread over several steps instead of freezing everyone's decode
     (chunked prefill).
  2. A chunk that needs more KV blocks than are free preempts the youngest running request (its blocks are
     freed; it goes back to the front of the queue and is recomputed later), until the chunk fits. Youngest
     first: it has the least work to lose, and the oldest requests keep making progress, so the system
     cannot livelock.
  3. Only if nobody was preempted, waiting requests are admitted in arrival order (first come, first served:
     no overtaking) while the budget, the free blocks and `max_running` allow.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .kv_sizing import blocks_for   # lesson 4's notebook and exercises import it from here too

R = TypeVar("R")   # whatever the caller schedules (the engine: its Sequence objects)


@dataclass(frozen=True, slots=True)
class SeqState:
    """What the scheduler needs to know about one request."""
    num_tokens: int       # prompt + generated so far
    num_computed: int     # of those, how many already have K/V in the cache
    num_blocks: int       # KV blocks it holds (all of them come back if it is preempted) ...
    num_freeable: int | None = None   # ... unless a prefix cache shares some with other requests (lesson 5):
                                      # then only this many come back

    @property
    def freeable(self) -> int:
        return self.num_blocks if self.num_freeable is None else self.num_freeable

    @property
    def remaining(self) -> int:   # tokens to run before its next sample; 1 means it is decoding
        return self.num_tokens - self.num_computed


@dataclass(slots=True)
class StepPlan:
    run: list[tuple[int, int]] = field(default_factory=list)    # (index into running, tokens this step)
    admit: list[tuple[int, int]] = field(default_factory=list)  # (index into waiting, tokens this step)
    preempt: list[int] = field(default_factory=list)            # indices into running, youngest first

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.run) + sum(n for _, n in self.admit)


def plan_step(running: list[SeqState], waiting: list[SeqState], free_blocks: int, token_budget: int,
              block_size: int, max_running: int = 1 << 30) -> StepPlan:
    """Decide one engine step. `running` and `waiting` are in arrival order (oldest first).

    Guarantees: at most `token_budget` tokens run; the blocks the chunks need never exceed `free_blocks` plus the
    blocks of the preempted requests; no admission in a step that preempts; waiting requests are admitted as a
    prefix of the queue (FCFS).
    """
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
            free += running[victim].freeable
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


@dataclass(slots=True)
class BoundPlan(Generic[R]):
    """A StepPlan with its indices replaced by the requests they name, so that applying it does not depend on list
    positions (which shift as soon as one request is removed from a queue)."""
    run: list[tuple[R, int]]       # (request, tokens this step), running ones in plan order
    admit: list[tuple[R, int]]     # (request, tokens this step), a prefix of the waiting list, in order
    preempt: list[R]               # youngest first


def bind(plan: StepPlan, running: list[R], waiting: list[R]) -> BoundPlan[R]:
    """Resolve `plan`'s indices against the very lists its SeqStates were made from, before anything moves."""
    return BoundPlan([(running[i], n) for i, n in plan.run], [(waiting[w], n) for w, n in plan.admit],
                     [running[i] for i in plan.preempt])
