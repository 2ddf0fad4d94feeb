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

import contextlib
import dataclasses
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence as Seq

import numpy as np

from .attention_backends import check_block_tables, get_paged_attention
from .block_manager import BlockManager
from .config import check_positive_int, is_int
from .drafters import Draft, make_drafter
from .model import Model, check_token_ids, forward
from .kv_sizing import blocks_for, max_kv_positions
from .paged import KVPool, slot_mapping, write_kv_unchecked
from .sampling import SamplingParams, sample
from .scheduler import bind, plan_step
from .speculative import AdaptiveK, SpecStats, draft_length, verify
from .sequence import Sequence, Status
from .stopping import StopChecker


class StepOutput(NamedTuple):
    request_id: int
    new_tokens: list[int]          # the token sampled this step (empty only when the request failed this step)
    finished: bool
    finish_reason: str | None      # "eos" | "length" | "context" | "stop" | "error" | "abort" once finished
    error: str | None = None       # finish_reason "error": what went wrong (the rest of the batch carried on)


@dataclass(frozen=True, slots=True)
class StepStats:
    num_seqs: int            # sequences in this step's batch (B)
    num_tokens: int          # rows of the flattened batch (T)
    num_decode: int          # of the B, how many were plain decodes (1 row, sampled)
    num_sampled: int         # rows that produced a token
    num_preempted: int
    num_admitted: int
    blocks_used: int         # after the step
    seconds: float
    num_drafted: int = 0     # lesson 6: draft tokens verified in this step's forward ...
    num_accepted: int = 0    # ... and how many of them the target accepted


@dataclass(slots=True)
class StepBatch:
    """One step's chunks of B sequences, flattened into T rows (sequence b owns rows query_starts[b]:[b+1]).
    Built and checked once per step; every layer's attention reads the same arrays."""
    seqs: list[Sequence]          # [B] in batch order
    counts: list[int]             # [B] rows each runs this step
    tokens: np.ndarray            # [T] int64
    positions: np.ndarray         # [T] int64
    write_blocks: np.ndarray      # [T] int64 pool block of each row's new K/V (slot // bs) ...
    write_offsets: np.ndarray     # [T] int64 ... and its offset in that block (slot % bs): split once, not per layer
    block_tables: np.ndarray      # [B, max_blocks] int64, -1 padded
    context_lens: np.ndarray      # [B] int64 positions of each sequence after this step
    query_starts: np.ndarray      # [B+1] int64
    sampled: list[int]            # [R] the b whose chunk reaches their last token: they sample this step
    logit_rows: np.ndarray        # [R] their last rows, the only ones the LM head runs on
    num_decode: int               # of the B, plain decodes (1 row after the last sample)
    logit_starts: list[int] | None = None   # [R] row of `logits` where each sampled sequence's rows begin (a
                                            # sequence verifying a draft of k needs k + 1 rows); None: one each


class Engine:
    def __init__(self, model: Model, num_blocks: int = 256, block_size: int = 16, max_batch_tokens: int = 256,
                 max_running: int = 64, backend: str = "numpy", tokenizer=None, prefix_caching: bool = False,
                 speculative=None, draft_k: int = 4, adaptive_k: bool = False, draft_model: Model | None = None,
                 verify_costs: Seq[float] | None = None):
        """speculative (lesson 6): None; "ngram", "early-exit", "int8"/"draft" (with draft_model); or a function
        returning a fresh Drafter, called once per request. draft_k: tokens drafted per step (the maximum when
        adaptive_k; verify_costs as for speculative.AdaptiveK)."""
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                            ("max_batch_tokens", max_batch_tokens), ("max_running", max_running)):
            check_positive_int(name, value, "Engine")
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.backend = backend
        self.tokenizer = tokenizer                # only needed for stop strings
        self._attend = get_paged_attention(backend, checked=False)   # each step checks its batch once
        self.pool = KVPool.create(self.config, num_blocks, block_size)   # [L, num_blocks, bs, K, H] x2
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=prefix_caching)  # all block bookkeeping
        self.waiting: deque[Sequence] = deque()   # arrival order; preempted requests go back to the front
        self.running: list[Sequence] = []         # arrival order (oldest first): the preemption order
        # finished requests and per-step stats are kept for the caller to read (metrics, generate); both grow
        # with use: a long-running caller (chat) calls pop_finished(rid) when done with a request
        self.finished: dict[int, Sequence] = {}
        self.stats: list[StepStats] = []          # one per step: a long-running caller may clear() it
        self._next_id = 0
        # lesson 6: speculative decoding
        if isinstance(speculative, str):
            kind = speculative
            speculative = lambda: make_drafter(kind, model, draft_model)   # noqa: E731
            speculative()                          # a bad kind or a missing draft model fails here, not per request
        self.make_drafter = speculative           # None: every request decodes one token per step
        self.draft_k = check_positive_int("draft_k", draft_k, "Engine")
        self.adaptive_k = adaptive_k
        self.verify_costs = tuple(verify_costs) if verify_costs is not None else None
        self.spec_stats = SpecStats()             # all requests together (each Sequence has its own in .spec)

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
        max_positions = max_kv_positions(len(ids), params.max_new_tokens, self.config.max_seq_len)
        need = blocks_for(max_positions, self.block_size)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs up to {max_positions} KV positions = {need} blocks of {self.block_size}, "
                             f"but the whole pool has {self.blocks.num_blocks} blocks: it can never run "
                             f"(shorten the prompt or max_new_tokens, or give the engine more blocks)")
        stopper = StopChecker(self.config, params, self.tokenizer, prompt_len=len(ids))  # ValueError on stop w/o tok
        seq = Sequence(self._next_id, [int(t) for t in ids], params, stopper, params.make_rng())
        if self.make_drafter is not None:
            seq.drafter, seq.spec = self.make_drafter(), SpecStats()
            if self.adaptive_k:
                seq.k_control = AdaptiveK(self.draft_k, seq.drafter.cost, self.verify_costs)
        return seq

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
        with interrupts_deferred():          # the queues and block tables change together or not at all
            failed = self._draft() if self.make_drafter is not None else []
            scheduled, n_preempted, n_admitted = self._schedule()
            if self.make_drafter is not None:
                self._fit_drafts(scheduled)
            if not scheduled:
                # add_request refuses what could never fit, so an empty plan with work left is a scheduler bug
                assert n_preempted or failed or not self.has_unfinished(), "the scheduler made no progress: a livelock"
                return failed
            batch = self._prepare_batch(scheduled)
            drafted = sum(len(seq.draft) for seq in batch.seqs)
        try:
            # Nothing is advanced until the forward has returned: if it raises, every sequence is as it was (its
            # new blocks stay allocated and hold nothing yet), and the next step runs the same chunks again.
            logits = self._forward(batch)                                                         # [R, V]
        except Exception as e:
            # one forward serves the whole batch, so its failure cannot be pinned on one request: all of them end,
            # the waiting ones carry on. (KeyboardInterrupt is not an Exception: it propagates, nothing is lost.)
            with interrupts_deferred():
                outputs = [self._fail(seq, e) for seq in batch.seqs]
        else:
            with interrupts_deferred():
                accepted_before = self.spec_stats.accepted
                outputs = self._advance(batch, logits)
        self.stats.append(StepStats(len(batch.seqs), len(batch.tokens), batch.num_decode, len(batch.sampled),
                                    n_preempted, n_admitted, self.blocks.allocator.num_used,
                                    time.perf_counter() - t0, drafted,
                                    self.spec_stats.accepted - accepted_before if drafted else 0))
        return failed + outputs

    # --- lesson 6: speculative decoding ------------------------------------------------------------------------
    def _draft(self) -> list[StepOutput]:
        """Every decoding request with a drafter proposes its next k tokens. They join the end of its output_ids
        as provisional tokens, so the scheduler, the block manager and the batch see one ordinary chunk of k + 1
        rows (the last sampled token + the draft); `_verify` keeps what the target agrees with. A draft only
        takes blocks the pool has spare: speculation must never push another request out."""
        failed: list[StepOutput] = []
        spare = self.blocks.num_free
        for seq in list(self.running):
            self._drop_draft(seq)                 # (a step interrupted by Ctrl-C may have left one)
            if seq.drafter is None or not seq.is_decoding:
                continue
            # never more positions than the request may ever hold (what add_request checked the pool against)
            room = max_kv_positions(len(seq.prompt_ids), seq.stopper.max_new_tokens, self.config.max_seq_len) \
                - seq.num_tokens
            k = draft_length(self.draft_k, seq.k_control, len(seq.output_ids), seq.stopper.max_new_tokens, room)
            base = self.blocks.blocks_needed(seq, 1)
            while k > 0 and self.blocks.blocks_needed(seq, 1 + k) - base > spare:
                k -= 1
            if k == 0:
                continue
            try:
                draft = seq.drafter.propose(seq.prompt_ids + seq.output_ids, k, seq.params, seq.rng)
            except Exception as e:                # a broken drafter ends its own request, not the batch
                failed.append(self._fail(seq, e))
                continue
            if not draft.tokens:
                continue
            spare -= self.blocks.blocks_needed(seq, 1 + len(draft)) - base
            seq.draft, seq.draft_probs = list(draft.tokens), draft.probs
            seq.output_ids.extend(seq.draft)
        return failed

    def _fit_drafts(self, scheduled: list[tuple[Sequence, int]]) -> None:
        """After scheduling: a draft keeps only the rows its request was given (the token budget may cut it), and a
        request that was not scheduled (or was preempted) drops its draft."""
        given = {seq.request_id: n for seq, n in scheduled}
        for seq in (*self.running, *self.waiting):
            if not seq.draft:
                continue
            n = given.get(seq.request_id, 0)
            if n == 0:
                self._drop_draft(seq)
            elif n < 1 + len(seq.draft):
                cut = len(seq.draft) - (n - 1)
                del seq.output_ids[-cut:]
                seq.draft = seq.draft[:n - 1]
                seq.draft_probs = seq.draft_probs[:n - 1] if seq.draft_probs is not None else None

    @staticmethod
    def _drop_draft(seq: Sequence) -> None:
        if seq.draft:
            del seq.output_ids[-len(seq.draft):]
            seq.draft, seq.draft_probs = [], None

    def _verify(self, seq: Sequence, n: int, logits: np.ndarray, now: float) -> StepOutput:
        """The forward ran seq's last sampled token + its draft (n = k + 1 rows, logits [k + 1, V]): keep the
        accepted prefix plus the target's own next token, rewind the rest, publish only verified blocks, stop
        exactly where plain decoding would (the stop rule sees the new tokens one by one)."""
        draft, probs = seq.draft, seq.draft_probs
        self._drop_draft(seq)                             # output_ids: the verified tokens only
        try:
            new = verify(logits, Draft(draft, probs), seq.params, seq.rng, seq.prompt_ids + seq.output_ids)
        except Exception as e:
            return self._fail(seq, e)
        accepted = len(new) - 1
        seq.num_computed_tokens += n                      # K/V of the last token and of all k drafts ...
        self.blocks.rewind(seq, len(draft) - accepted)    # ... minus the rejected ones
        kept: list[int] = []
        done = False
        try:
            for token in new:
                seq.output_ids.append(token)
                seq.token_times.append(now)
                kept.append(token)
                if seq.stopper.should_stop(seq.output_ids):
                    done = True
                    break
        except Exception as e:
            return self._fail(seq, e, kept)
        # stopped inside the accepted run: the K/V of the tokens cut off go too (cache = every token but the newest)
        self.blocks.rewind(seq, max(0, seq.num_computed_tokens - (seq.num_tokens - 1)))
        assert seq.num_computed_tokens == seq.num_tokens - 1, "after verification the cache holds all but the newest"
        self.blocks.commit(seq)                           # only now: every computed position is verified
        for stats in (seq.spec, self.spec_stats):
            stats.record(len(draft), accepted)
            stats.emitted += len(kept)
        if seq.k_control is not None:
            seq.k_control.update(len(draft), accepted)
        if done:
            self._finish(seq)
        return StepOutput(seq.request_id, kept, done, seq.finish_reason)

    def _prepare_batch(self, scheduled: list[tuple[Sequence, int]]) -> StepBatch:
        """Flatten the scheduled chunks into one batch of rows, and check its layout once for all layers."""
        bs = self.block_size
        seqs = [seq for seq, _ in scheduled]
        counts = [n for _, n in scheduled]
        starts = [seq.num_computed_tokens for seq in seqs]             # each chunk continues where its K/V end
        tokens = np.concatenate([np.asarray(seq.token_slice(s, s + n), dtype=np.int64)
                                 for seq, s, n in zip(seqs, starts, counts)])                   # [T]
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])        # [T]
        slots = np.concatenate([slot_mapping(seq.block_table, s, n, bs)
                                for seq, s, n in zip(seqs, starts, counts)])                     # [T]
        width = max(len(seq.block_table) for seq in seqs)
        block_tables = np.full((len(seqs), width), -1, dtype=np.int64)                            # [B, max_blocks]
        for b, seq in enumerate(seqs):
            block_tables[b, :len(seq.block_table)] = seq.block_table
        context_lens = np.array([s + n for s, n in zip(starts, counts)], dtype=np.int64)          # [B]
        query_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)                 # [B+1]
        check_block_tables(block_tables, context_lens, query_starts, len(tokens), self.pool.num_blocks, bs)
        # Only the sequences whose chunk reaches their last token sample; only their last rows need the LM head.
        sampled = [b for b, seq in enumerate(seqs) if starts[b] + counts[b] == seq.num_tokens]
        logit_rows = query_starts[1:][sampled] - 1                                                # [R]
        num_decode = sum(seq.is_decoding for seq in seqs)
        logit_starts = None
        if any(seqs[b].draft for b in sampled):
            # lesson 6: a sequence verifying a draft of k needs the logits of all its k + 1 rows
            n_rows = [1 + len(seqs[b].draft) for b in sampled]
            logit_rows = np.concatenate([np.arange(end - r, end) for end, r in zip(logit_rows + 1, n_rows)])
            logit_starts = np.concatenate([[0], np.cumsum(n_rows)[:-1]]).tolist()
        return StepBatch(seqs, counts, tokens, positions, slots // bs, slots % bs, block_tables, context_lens,
                         query_starts, sampled, logit_rows, num_decode, logit_starts)

    def _forward(self, batch: StepBatch) -> np.ndarray:
        """One forward over all rows of the batch -> logits [R, V] of its sampled rows. Attention is the only
        per-sequence part: each layer writes the new K/V through the slot mapping, then reads every sequence's
        K/V through its block table. The batch was checked once in _prepare_batch, so the L calls per step skip
        the public functions' checks and conversions (at B=16 these cost ~1 ms per step)."""
        pool, attend = self.pool, self._attend

        def attention(layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
            # the new rows first: they attend to themselves
            write_kv_unchecked(pool.k[layer], pool.v[layer], batch.write_blocks, batch.write_offsets, k, v)
            return attend(q, pool.k[layer], pool.v[layer], batch.block_tables, batch.context_lens,
                          batch.query_starts)

        with self._threads():
            logits = forward(self.model, batch.tokens, batch.positions, attention, logit_rows=batch.logit_rows)
        if self.backend == "numba":
            from .kernels import check_threading_layer
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
            if seq.draft:                     # lesson 6: k + 1 rows to verify
                outputs.append(self._verify(seq, n, logits[row[b]:row[b] + n], now))
                continue
            try:
                # the repetition penalty needs every token seen so far; skip building that list when it is off
                seen = seq.prompt_ids + seq.output_ids if seq.params.repetition_penalty != 1.0 else ()
                token = sample(logits[row[b]], seq.params, seq.rng, seen=seen)
            except Exception as e:            # e.g. NaN logits: this request ends, the batch goes on
                outputs.append(self._fail(seq, e))
                continue
            seq.output_ids.append(token)
            seq.token_times.append(now)
            if seq.spec is not None:          # a step without a draft (prefill, or k = 0): one token, no verdict
                for stats in (seq.spec, self.spec_stats):
                    stats.record(0, 0)
                    stats.emitted += 1
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
            try:
                done = seq.stopper.should_stop(seq.output_ids)
            except Exception as e:            # e.g. the tokenizer failed to decode for a stop string
                outputs.append(self._fail(seq, e, [token]))
                continue
            if done:
                self._finish(seq)
            outputs.append(StepOutput(seq.request_id, [token], done, seq.finish_reason))
        return outputs

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
        self._drop_draft(seq)                 # unverified tokens are not output (their K/V were never counted)
        self.blocks.free(seq)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.finished[seq.request_id] = seq

    def _threads(self):
        """With the Numba backend, keep OpenBLAS to one thread during the step (two pools on 2 cores ~10x slower)."""
        if self.backend == "numba":
            from .kernels import single_thread_blas
            return single_thread_blas()
        return contextlib.nullcontext()

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


@contextlib.contextmanager
def interrupts_deferred():
    """Hold back Ctrl-C (SIGINT) until the block has ended, then raise KeyboardInterrupt.

    The engine's bookkeeping (queues, block tables, refcounts, the prefix trie) must change all together or not at
    all: a KeyboardInterrupt landing between popping a request off the queue and adding it to `running` would lose
    it, with its blocks. Only in the main thread, and only while Python's own handler is installed (an
    application that installed its own SIGINT handler keeps it)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


def generate_stream(model: Model, ids: Seq[int], max_new_tokens: int | None = None,
                    params: SamplingParams | None = None, tokenizer=None, backend: str = "numpy",
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
    positions = max_kv_positions(n_prompt, params.max_new_tokens, model.config.max_seq_len)
    engine = Engine(model, num_blocks=blocks_for(positions, block_size), block_size=block_size,
                    max_batch_tokens=max_batch_tokens, backend=backend, tokenizer=tokenizer, **engine_kwargs)
    rid = engine.add_request(ids, params)
    while engine.has_unfinished():
        for out in engine.step():
            yield from out.new_tokens
    if spec_stats is not None and engine.finished[rid].spec is not None:
        stats = engine.finished[rid].spec
        for name in ("steps", "drafted", "accepted", "rejected", "emitted", "ks", "accepts"):
            setattr(spec_stats, name, getattr(stats, name))
