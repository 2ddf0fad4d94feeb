"""Lesson 4: one request as the engine sees it — its tokens, where its K/V live, how far it has got.

A sequence is in one of three states: WAITING (queued, or preempted and waiting to be recomputed), RUNNING
(holds KV blocks and is scheduled every step) or FINISHED. The one number that drives scheduling is
`num_computed_tokens`: how many of its tokens already have K/V in the cache. Every step runs the next chunk
`tokens[num_computed_tokens : num_computed_tokens + n]`; when that chunk reaches the end of the sequence its last
row's logits give the next token. A prompt's prefill, a prefill chunk, a decode step (n = 1) and a recompute after
preemption (num_computed_tokens reset to 0, the generated tokens kept) are all the same operation.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import numpy as np

from .constrained import ConstraintState
from .drafters import Drafter
from .sampling import SamplingParams
from .speculative import AdaptiveK, SpecStats
from .stopping import StopChecker


@dataclass(slots=True)
class SpecState:
    """Lesson 6: one request's speculative decoding (spec_step.Speculator gives each request its own). Within one
    engine step the drafted tokens sit at the end of output_ids, so scheduling, blocks and the batch treat them as
    an ordinary chunk of 1 + k rows; verification then keeps what the target agrees with. Between steps `draft` is
    always empty."""
    drafter: Drafter                           # this request's own (a model drafter holds a KV cache)
    stats: SpecStats                           # what verification did for this request
    k_control: AdaptiveK | None = None         # picks k per step from the measured acceptance (None: fixed k)
    draft: list[int] = field(default_factory=list)           # [k] the unverified tail of output_ids
    draft_probs: np.ndarray | None = None      # [k, V] the q they were drawn from (stochastic verification)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stopper: StopChecker
    rng: np.random.Generator                   # per request: its samples do not depend on the batch around it
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)   # logical block i -> physical block id in the pool
    local_table: list[int] = field(default_factory=list)   # lesson 11: the same for the sliding-window layers'
                                                           # pool; -1 where a block fell behind the window
    num_computed_tokens: int = 0               # tokens whose K/V are in the cache (reset to 0 by preemption)
    status: Status = Status.WAITING
    num_preemptions: int = 0
    error: str | None = None                   # why it ended, when finish_reason is "error"
    # timestamps (time.perf_counter seconds) for the per-request metrics
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    token_times: list[float] = field(default_factory=list)   # when each output token was sampled
    spec: SpecState | None = None              # lesson 6: its speculation state (None: one token per step)

    @property
    def constraint(self) -> ConstraintState | None:   # structured output: its place in its grammar (None: free text)
        return self.stopper.constraint

    @property
    def num_tokens(self) -> int:               # prompt + generated so far
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_remaining(self) -> int:            # tokens still to run through the model before the next sample
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:             # only the last sampled token is new: one row this step
        return self.num_remaining == 1 and bool(self.output_ids)

    @property
    def num_drafted(self) -> int:              # lesson 6: unverified draft tokens at the end of output_ids
        return len(self.spec.draft) if self.spec is not None else 0

    def drop_draft(self) -> None:
        """Take the unverified draft off output_ids (their K/V were never counted as computed)."""
        if self.spec is not None and self.spec.draft:
            del self.output_ids[-len(self.spec.draft):]
            self.spec.draft, self.spec.draft_probs = [], None

    def resume_prefilled(self, first_token: int, first_token_time: float | None, rng_state: dict | None) -> None:
        """Lesson 8: this sequence's whole prompt was computed (and its first token sampled) by another engine, and
        its K/V are already in its blocks: it runs from its first decode."""
        self.num_computed_tokens, self.status, self.first_scheduled_time = len(self.prompt_ids), Status.RUNNING, \
            time.perf_counter()
        self.output_ids.append(int(first_token))
        if self.constraint is not None:  # ValueError if the prefill engine sampled it unconstrained
            self.constraint.advance(int(first_token))
        self.token_times.append(first_token_time if first_token_time is not None else time.perf_counter())
        if rng_state is not None:        # continue the sampler's random stream where prefill left it
            self.rng.bit_generator.state = rng_state

    def token_slice(self, start: int, stop: int) -> list[int]:
        """tokens[start:stop] of prompt + output, without building the concatenation."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p:stop - p]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def finish_reason(self) -> str | None:     # "eos" | "length" | "context" | "stop" | "error" | "abort"
        return self.stopper.reason

    def metrics(self) -> "RequestMetrics":
        return RequestMetrics.of(self)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    queue_time: float          # arrival -> first scheduled (s)
    ttft: float                # arrival -> first token (s)
    itl: tuple[float, ...]     # inter-token latencies (s), len = output tokens - 1
    tokens_per_s: float        # output tokens / (arrival -> last token)
    num_output_tokens: int
    num_preemptions: int
    draft_alpha: float | None = None          # speculative decoding: acceptance per examined draft token ...
    tokens_per_step: float | None = None      # ... and output tokens per target forward (None without a drafter)

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        t = seq.token_times
        if not t:
            raise ValueError(f"request {seq.request_id} has produced no token yet")
        total = t[-1] - seq.arrival_time
        return cls(queue_time=(seq.first_scheduled_time or t[0]) - seq.arrival_time,
                   ttft=t[0] - seq.arrival_time,
                   itl=tuple(float(d) for d in np.diff(t)),
                   tokens_per_s=len(t) / total if total > 0 else float("inf"),
                   num_output_tokens=len(seq.output_ids),
                   num_preemptions=seq.num_preemptions,
                   draft_alpha=seq.spec.stats.alpha if seq.spec is not None else None,
                   tokens_per_step=seq.spec.stats.tokens_per_step if seq.spec is not None else None)
