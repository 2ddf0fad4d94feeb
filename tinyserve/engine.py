"""Lesson 4: the Engine — continuous batching over a paged KV cache.

    engine = Engine(model, num_blocks=256, block_size=16, max_batch_tokens=256)
    rid = engine.add_request(prompt_ids, SamplingParams(temperature=0, max_new_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():          # StepOutput(request_id, new_tokens, finished, finish_reason)
            ...

One step = schedule (scheduler.plan_step) -> one forward over the chunks of *all* scheduled sequences, flattened
into one [T] batch (decode tokens and prefill chunks side by side: the matmuls, which dominate the cost, read
each weight once for the whole batch) -> sample one token for every sequence whose chunk reached its end ->
retire the finished ones and free their blocks. Attention is the only per-sequence part: each layer writes the
new K/V into the pool through the slot mapping and runs paged attention with every sequence's block table.

Impossible requests are refused by `add_request` with a ValueError (bad ids, bad params, longer than the context
window, or needing more KV blocks than the whole pool); the requests already queued are not affected.

One request never takes the others down. If sampling or stopping fails for one request, that request alone finishes
with finish_reason "error" (StepOutput.error says why) and its blocks are freed; if the batched forward itself
raises, every request of that batch finishes so, and the waiting ones carry on. Ctrl-C (KeyboardInterrupt) is held
back during the bookkeeping and let through only where nothing has been advanced (the forward), so after it the
engine is as before the step and the next step redoes that work. `abort(request_id)` ends a request at once.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable, Iterator, Sequence as Seq

import numpy as np

from .attention_backends import KVLayout, get_paged_attention
from .block_manager import BlockManager
from .config import check_positive_int, is_int
from .backend import check_threading_layer, forward, step_threads
from .model import Model, check_token_ids
from .kv_sizing import max_kv_blocks, max_kv_positions
from .interrupts import interrupts_deferred, interrupts_held
from .paged import LayerPools, local_step_tables
from .sampling import SamplingParams, sample_tokens
from .scheduler import bind, plan_step
from .spec_step import OneTokenSteps, SpecConfig, Speculator, Verdict, step_strategy
from .speculative import SpecStats
from .sequence import Sequence, Status
from .step_batch import StepBatch, StepOutput, StepStats, prepare_batch   # StepOutput, StepStats: also imported
from .stopping import StopChecker                                         # from here by callers and tests


class Engine:
    def __init__(self, model: Model, num_blocks: int = 256, block_size: int = 16, max_batch_tokens: int = 256,
                 max_running: int = 64, backend: str | None = None, tokenizer=None, prefix_caching: bool = False,
                 speculative: SpecConfig | str | Callable | None = None, num_local_blocks: int | None = None,
                 **spec_options):
        """speculative (lesson 6): None (one token per step), a spec_step.SpecConfig, or its drafter: "ngram",
        "early-exit", "int8"/"draft" (with draft_model=), or a function returning a fresh Drafter (called once per
        request), with SpecConfig's other fields as keywords: Engine(model, speculative="ngram", draft_k=4).
        num_local_blocks: lesson 11's sliding-window layers' pool (paged.LayerPools.create says how it is sized)."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("max_batch_tokens", max_batch_tokens), ("max_running", max_running)):
            check_positive_int(name, value, "Engine")
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.backend = backend or model.backend   # the attention kernel follows the model's backend (lesson 7)
        self.tokenizer = tokenizer                # only needed for stop strings and json_schema
        self._attend = get_paged_attention(self.backend, checked=False)   # each step checks its batch once
        self.kv = LayerPools.create(self.config, num_blocks, block_size, max_running, max_batch_tokens,
                                    num_local_blocks)
        self.pool, self.local_pool = self.kv.pool, self.kv.local_pool   # lesson 11: the local layers' own pool
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching, window=self.kv.window,
                                   num_local_blocks=self.kv.num_local_blocks)  # all block bookkeeping
        self.waiting: deque[Sequence] = deque()   # arrival order; preempted requests go back to the front
        self.running: list[Sequence] = []         # arrival order (oldest first): the preemption order
        # finished requests and per-step stats are kept for the caller to read (metrics, generate); both grow
        # with use: a long-running caller (chat) calls pop_finished(rid) when done with a request
        self.finished: dict[int, Sequence] = {}
        self.stats: list[StepStats] = []          # one per step: a long-running caller may clear() it
        self._next_id = 0
        # how a step decodes: one token per request, or lesson 6's draft-and-verify (spec_step.py); the step below
        # calls the same four methods either way
        self.steps: OneTokenSteps | Speculator = step_strategy(model, speculative, **spec_options)

    # --- requests --------------------------------------------------------------------------------------------
    def add_request(self, prompt_ids: Seq[int], params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises ValueError at once if it could never be served."""
        seq = self._new_sequence(prompt_ids, params)
        self._next_id += 1
        self.waiting.append(seq)
        return seq.request_id

    def _new_sequence(self, prompt_ids: Seq[int], params: SamplingParams | None) -> Sequence:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = check_token_ids(self.config, prompt_ids)
        # If even the whole pool cannot hold the most positions it can ever reach, preempting everyone else would
        # not help.
        need = max_kv_blocks(len(ids), params.max_new_tokens, self.config.max_seq_len, self.block_size)
        if need > self.blocks.num_blocks:
            max_positions = max_kv_positions(len(ids), params.max_new_tokens, self.config.max_seq_len)
            raise ValueError(f"request needs up to {max_positions} KV positions = {need} blocks of {self.block_size}, "
                             f"but the whole pool has {self.blocks.num_blocks} blocks: it can never run "
                             f"(shorten the prompt or max_new_tokens, or give the engine more blocks)")
        stopper = StopChecker(self.config, params, self.tokenizer, prompt_len=len(ids))  # ValueError on stop w/o tok
        seq = Sequence(self._next_id, [int(t) for t in ids], params, stopper, params.make_rng())
        self.steps.attach(seq)
        return seq

    def add_prefilled(self, prompt_ids: Seq[int], params: SamplingParams | None, first_token: int, k: np.ndarray,
                      v: np.ndarray, rng_state: dict | None = None, first_token_time: float | None = None) -> int:
        """Lesson 8: a request whose prompt K/V (k, v: [L, P, K, H]) and first token another engine computed joins
        `running` at once; it skips the scheduler, so the caller checks that blocks_for(P + 1) blocks are free."""
        if k.shape != v.shape or k.shape[1] != len(prompt_ids):
            raise ValueError(f"K/V for {len(prompt_ids)} prompt positions expected, got k {k.shape}, v {v.shape}")
        seq = self._new_sequence(prompt_ids, params)
        self._next_id += 1
        with interrupts_deferred():          # the block table and the queues change together or not at all
            seq.num_computed_tokens = len(seq.prompt_ids)     # computed elsewhere: a local table starts at the window
            self.blocks.allocate(seq, 0)
            self.kv.write_prompt(seq.block_table, k, v, seq.local_table)
            seq.resume_prefilled(first_token, first_token_time, rng_state)
            self.running.append(seq)
        return seq.request_id

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def sequence(self, request_id: int) -> Sequence:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return self.finished[request_id]

    def abort(self, request_id: int) -> bool:
        """End a request now (a client went away, Ctrl-C in the chat). Returns True if it was waiting or running:
        its blocks are freed at once and it moves to `finished` with finish_reason "abort" (no StepOutput is
        emitted for it). Returns False if it had already finished (popped or not). Raises KeyError for an id this
        engine never handed out."""
        with interrupts_deferred():
            for seq in (*self.running, *self.waiting):
                if seq.request_id == request_id:
                    self._finish(seq, "abort")
                    return True
        if is_int(request_id) and 0 <= request_id < self._next_id:
            return False
        raise KeyError(f"no request {request_id!r}: this engine handed out ids 0..{self._next_id - 1}")

    def pop_finished(self, request_id: int) -> Sequence:
        """Hand back a finished request and forget it (its Sequence and its prefix-cache hit count). A long-running
        engine calls this once it has read what it needs, or `finished` grows by one Sequence per request."""
        seq = self.finished.pop(request_id)
        self.blocks.forget(request_id)
        return seq

    # --- one step --------------------------------------------------------------------------------------------
    def _schedule(self) -> tuple[list[tuple[Sequence, int]], int, int]:
        """Apply scheduler.plan_step to the queues: preempt, admit, allocate.
        Returns the batch [(seq, tokens this step)], the number preempted, the number admitted."""
        waiting = self.blocks.admissible(list(self.waiting), self.running, self.max_batch_tokens)  # lesson 5
        plan = plan_step([self.blocks.seq_state(s) for s in self.running],
                         [self.blocks.seq_state(s) for s in waiting],
                         self.blocks.num_free, self.max_batch_tokens, self.block_size, self.max_running)
        chosen = bind(plan, self.running, waiting)     # the plan's indices, turned into the sequences they name
        for seq in chosen.preempt:                     # youngest first, so the oldest victim ends up at the front
            self.blocks.free(seq)                      # its K/V are gone; its output tokens are kept for the recompute
            seq.status = Status.WAITING
            seq.num_preemptions += 1
            self.running.remove(seq)
            self.waiting.appendleft(seq)
        now = time.perf_counter()
        for seq, _ in chosen.admit:
            assert self.waiting[0] is seq, "FCFS: admit from the front of the queue, in order"
            self.waiting.popleft()
            self.blocks.admit(seq)
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
        batch = chosen.run + chosen.admit
        for seq, n in batch:
            self.blocks.allocate(seq, n)
        return batch, len(chosen.preempt), len(chosen.admit)

    def step(self) -> list[StepOutput]:
        """Schedule, run one batched forward, sample, retire. Returns one StepOutput per sampled token, and one
        per request that failed in this step (finish_reason "error")."""
        t0 = time.perf_counter()
        steps = self.steps
        with interrupts_held() as deferred:    # one SIGINT handler a step: Ctrl-C may cut the forward, not the
            with deferred:                     # bookkeeping (the queues and block tables change all together)
                failed = [self._fail(seq, e) for seq, e in steps.draft_all(self.running, self.blocks)]
                scheduled, n_preempted, n_admitted = self._schedule()
                steps.fit_drafts(scheduled, (*self.running, *self.waiting))
                if not scheduled:
                    # add_request refuses what could never fit: an empty plan with work left is a scheduler bug
                    assert n_preempted or failed or not self.has_unfinished(), "no progress: a livelock"
                    return failed
                batch = prepare_batch(scheduled, self.pool.num_blocks, self.block_size)   # step_batch.py
                drafted, accepted_before = sum(seq.num_drafted for seq in batch.seqs), steps.stats.accepted
            try:
                # Nothing is advanced until the forward has returned: if it raises, every sequence is as it was (its
                # new blocks stay allocated and hold nothing yet), and the next step runs the same chunks again.
                logits = self._forward(batch)                                                         # [R, V]
            except Exception as e:
                # one forward serves the whole batch, so its failure cannot be pinned on one request: all of them
                # end, the waiting ones carry on (a KeyboardInterrupt is no Exception: it propagates, nothing lost)
                with deferred:
                    outputs = [self._fail(seq, e) for seq in batch.seqs]
            else:
                with deferred:
                    outputs = self._advance(batch, logits)
        self.stats.append(StepStats(len(batch.seqs), len(batch.tokens), batch.num_decode, len(batch.sampled),
                                    n_preempted, n_admitted, self.blocks.allocator.num_used, time.perf_counter() - t0,
                                    drafted, steps.stats.accepted - accepted_before))
        return failed + outputs

    def _forward(self, batch: StepBatch) -> np.ndarray:
        """One forward over all rows of the batch -> logits [R, V] of its sampled rows. Attention is the only
        per-sequence part: each layer writes the new K/V through the slot mapping, then reads every sequence's
        K/V through its block table. The batch was checked once in prepare_batch, so the L calls per step skip
        the public functions' checks and conversions (at batch 16 those would cost a visible share of a step)."""
        pool = self.pool
        attention = self.kv.attention_fn(self._attend, batch)   # each layer: write the new K/V, then attend

        layout = None     # lesson 7: a few rows that all need logits (decodes, verifies) may run as one kernel
        every_row = len(batch.logit_rows) == len(batch.tokens)      # that also writes the K/V
        if self.backend == "numba" and every_row:                   # row: its sequence's block table
            L, nb, bs, K, H = pool.k.shape
            one_each = batch.num_decode == len(batch.tokens)      # decodes only: row b is sequence b, no copy
            row_seq = slice(None) if one_each else np.repeat(np.arange(len(batch.seqs)), batch.counts)
            local = {}
            if self.local_pool is not None:    # lesson 11: the local layers' pool and tables (checked by attention_fn)
                Ll, nl = self.local_pool.k.shape[:2]
                tables, _ = local_step_tables([seq.local_table for seq in batch.seqs], batch.counts,
                                              batch.positions, bs)
                local = dict(local_k=self.local_pool.k.reshape(Ll, nl * bs, K, H),
                             local_v=self.local_pool.v.reshape(Ll, nl * bs, K, H), local_block_tables=tables[row_seq])
            layout = KVLayout(pool.k.reshape(L, nb * bs, K, H), pool.v.reshape(L, nb * bs, K, H),
                              batch.block_tables[row_seq], bs, batch.positions + 1, **local)
        with step_threads(self.backend):   # logit_rows=None asks for every row, which is what logit_rows names
            logits = forward(self.model, batch.tokens, batch.positions, attention,      # when it has T
                             logit_rows=None if every_row else batch.logit_rows, kv_layout=layout)
        if self.backend == "numba":
            check_threading_layer()          # warns (once) if numba fell back to its slow thread pool
        return logits

    def _advance(self, batch: StepBatch, logits: np.ndarray) -> list[StepOutput]:
        """After the forward: count every chunk's K/V as computed (and publish full blocks), sample one token for
        every sequence whose chunk reached its end (logits [R, V], row r for batch.sampled[r]), retire those that
        stop. A failure while sampling or stopping one sequence ends that sequence only."""
        outputs: list[StepOutput] = []
        row = dict(zip(batch.sampled, batch.logit_starts or range(len(batch.sampled))))  # batch index -> logits row
        now = time.perf_counter()
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.counts)):
            if b not in row:                  # a prefill chunk short of the end: its K/V are in, nothing to sample
                seq.num_computed_tokens += n
                self.blocks.commit(seq)
                continue
            if seq.num_drafted:               # lesson 6: k + 1 rows to verify
                verdict = self.steps.verify(seq, n, logits[row[b]:row[b] + n], now, self.blocks)
                outputs.append(self._conclude(seq, verdict))
                continue
            try:
                # the repetition penalty needs every token seen so far; skip building that list when it is off
                seen = seq.prompt_ids + seq.output_ids if seq.params.repetition_penalty != 1.0 else ()
                new, logprobs = sample_tokens(seq, logits[row[b]], seen)   # [token] (+ a grammar's forced ones)
            except Exception as e:            # e.g. NaN logits: this request ends, the batch goes on
                outputs.append(self._fail(seq, e))
                continue
            seq.output_ids.extend(new)
            seq.token_times.extend([now] * len(new))
            self.steps.record(seq, 0, 0, len(new))   # a step without a draft (prefill, k = 0, speculation off)
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
            try:
                done = seq.stopper.should_stop(seq.output_ids)
            except Exception as e:            # e.g. the tokenizer failed to decode for a stop string
                outputs.append(self._fail(seq, e, new))
                continue
            if done:
                self._finish(seq)
            outputs.append(StepOutput(seq.request_id, new, done, seq.finish_reason, logprobs=logprobs))
        return outputs

    def _conclude(self, seq: Sequence, verdict: Verdict) -> StepOutput:
        """Lesson 6: the StepOutput of a verified draft; a request that stopped or failed inside it is retired."""
        if verdict.error is not None:
            return self._fail(seq, verdict.error, verdict.tokens)
        if verdict.done:
            self._finish(seq)
        return StepOutput(seq.request_id, verdict.tokens, verdict.done, seq.finish_reason)

    def _fail(self, seq: Sequence, error: Exception, new_tokens: list[int] | None = None) -> StepOutput:
        """End `seq` because something raised while serving it; the message goes to the caller."""
        self._finish(seq, "error", f"{type(error).__name__}: {error}")
        return StepOutput(seq.request_id, new_tokens or [], True, "error", seq.error)

    def _finish(self, seq: Sequence, reason: str | None = None, error: str | None = None) -> None:
        """Retire a running or waiting sequence: free its blocks, move it to `finished`. `reason` overrides the
        stopper's ("error", "abort"): the stopper's `reason` is the one place a finish reason lives."""
        if reason is not None:
            seq.stopper.reason = reason
            seq.error = error
        seq.drop_draft()                      # unverified tokens are not output (their K/V were never counted)
        self.blocks.free(seq)
        (self.running if seq.status is Status.RUNNING else self.waiting).remove(seq)
        seq.status = Status.FINISHED
        self.finished[seq.request_id] = seq

    @property
    def speculator(self) -> Speculator | None:
        """Lesson 6's Speculator when this engine speculates, else None."""
        return self.steps if isinstance(self.steps, Speculator) else None

    # --- conveniences ----------------------------------------------------------------------------------------
    def run(self, progress=None) -> None:
        """Step until every queued request has finished. `progress(outputs)` is called after each step."""
        while self.has_unfinished():
            outs = self.step()
            if progress is not None:
                progress(outs)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[list[int]]:
        """New token ids per prompt (like naive.generate), all prompts served together by continuous batching.
        Every prompt is validated before any runs: one impossible prompt raises ValueError for the whole call."""
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        params = list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        for p, sp in zip(prompts, params):
            self._new_sequence(p, sp)            # validate them all before queueing any
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.run()
        failed = [(i, self.finished[i].error) for i in ids if self.finished[i].finish_reason == "error"]
        if failed:   # never hand back a cut-off output as if it were complete
            raise RuntimeError("; ".join(f"request {i} failed: {e}" for i, e in failed))
        return [list(self.finished[i].output_ids) for i in ids]

    @property
    def peak_blocks_used(self) -> int:
        return max((s.blocks_used for s in self.stats), default=0)

    def describe(self, max_blocks: int = 64) -> str:
        """A printable view of the pool: which request owns each block (refcount), and every block table."""
        owner: dict[int, list[int]] = {}
        for seq in self.running:
            for blk in seq.block_table:
                owner.setdefault(blk, []).append(seq.request_id)
        alloc = self.blocks.allocator
        lines = [f"KV pool: {alloc.num_used}/{alloc.num_blocks} blocks used, block size {self.block_size}, "
                 f"{self.pool.nbytes / 2**20:.1f} MiB ({len(self.running)} running, {len(self.waiting)} waiting)"]
        cells = []
        for blk in range(min(alloc.num_blocks, max_blocks)):
            rc = alloc.refcount[blk]
            who = ",".join(f"r{r}" for r in owner.get(blk, [])) or ("?" if rc else ".")
            cells.append(f"{blk:>3}:{who}" + (f"x{rc}" if rc > 1 else ""))
        for i in range(0, len(cells), 8):
            lines.append("  " + "  ".join(f"{c:<10}" for c in cells[i:i + 8]))
        if alloc.num_blocks > max_blocks:
            lines.append(f"  ... {alloc.num_blocks - max_blocks} more blocks")
        for seq in self.running:
            fill = seq.num_computed_tokens - (len(seq.block_table) - 1) * self.block_size
            lines.append(f"  r{seq.request_id}: {seq.num_tokens} tokens ({seq.num_computed_tokens} in cache), "
                         f"block table {seq.block_table} (last block {max(fill, 0)}/{self.block_size} full)")
        for seq in self.waiting:
            lines.append(f"  r{seq.request_id}: waiting, {seq.num_tokens} tokens"
                         + (f" (preempted {seq.num_preemptions}x)" if seq.num_preemptions else ""))
        return "\n".join(lines)

    __str__ = describe


def generate_stream(model: Model, ids: Seq[int], max_new_tokens: int | None = None,
                    params: SamplingParams | None = None, tokenizer=None, backend: str | None = None,
                    block_size: int = 16, max_batch_tokens: int = 512, spec_stats: SpecStats | None = None,
                    **engine_kwargs) -> Iterator[int]:
    """One prompt through the engine (the CLI's --strategy paged): yields token ids as they are sampled.
    The pool is sized for exactly this request (a draft never reaches past the positions the request may hold).
    engine_kwargs go to Engine (e.g. speculative="ngram", draft_k=8); spec_stats, if given, receives the request's
    acceptance statistics when it ends."""
    params = params or SamplingParams()
    if max_new_tokens is not None:
        params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
    n_prompt = len(check_token_ids(model.config, ids))
    num_blocks = max_kv_blocks(n_prompt, params.max_new_tokens, model.config.max_seq_len, block_size)
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size,
                    max_batch_tokens=max_batch_tokens, backend=backend, tokenizer=tokenizer, **engine_kwargs)
    rid = engine.add_request(ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            yield from out.new_tokens
    if spec_stats is not None and engine.finished[rid].spec is not None:
        stats = engine.finished[rid].spec.stats
        for name in ("steps", "drafted", "accepted", "rejected", "emitted", "ks", "accepts"):
            setattr(spec_stats, name, getattr(stats, name))
