"""Lesson 4: one engine step's batch — the chunks of B sequences flattened into T rows, checked once — and what a
step hands back (StepOutput per request, StepStats per step).

Continuous batching runs decodes (1 row each) and prefill chunks (many rows) in one forward. The model sees one
[T] array of tokens and positions; attention alone is per sequence, so it gets the layout: where each sequence's
rows start (query_starts), how far its context reaches (context_lens), its block table, and where each row's new
K/V go in the pool (slot = block * bs + offset). Everything here depends on the step, not on the layer, so it is
built and checked once per step and read by all L layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .attention_backends import check_block_tables
from .paged import slot_mapping
from .sequence import Sequence


class StepOutput(NamedTuple):
    request_id: int
    new_tokens: list[int]          # the tokens this step added (empty only when the request failed this step)
    finished: bool
    finish_reason: str | None      # "eos" | "length" | "context" | "stop" | "error" | "abort" once finished
    error: str | None = None       # finish_reason "error": what went wrong (the rest of the batch carried on)
    logprobs: list | None = None   # params.logprobs set: one sampling.token_logprobs result per new token


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
    logit_starts: list[int] | None = None   # [R] row of `logits` where each sampled sequence's rows begin (lesson 6:
                                            # a sequence verifying a draft of k needs k + 1 rows); None: one each


def prepare_batch(scheduled: list[tuple[Sequence, int]], num_pool_blocks: int, block_size: int) -> StepBatch:
    """Flatten the scheduled chunks into one batch of rows, and check its layout once for all layers. The common
    step, decodes only, takes a shorter way to the same batch (decode_batch)."""
    if all(n == 1 and seq.is_decoding for seq, n in scheduled):
        return decode_batch([seq for seq, _ in scheduled], num_pool_blocks, block_size)
    return chunk_batch(scheduled, num_pool_blocks, block_size)


def chunk_batch(scheduled: list[tuple[Sequence, int]], num_pool_blocks: int, block_size: int) -> StepBatch:
    """prepare_batch for any mix of chunks: prefill chunks, decodes, speculative verifies."""
    bs = block_size
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
    check_block_tables(block_tables, context_lens, query_starts, len(tokens), num_pool_blocks, bs)
    # Only the sequences whose chunk reaches their last token sample; only their last rows need the LM head.
    sampled = [b for b, seq in enumerate(seqs) if starts[b] + counts[b] == seq.num_tokens]
    logit_rows = query_starts[1:][sampled] - 1                                                # [R]
    num_decode = sum(seq.is_decoding for seq in seqs)
    logit_starts = None
    if any(seqs[b].num_drafted for b in sampled):
        # lesson 6: a sequence verifying a draft of k needs the logits of all its k + 1 rows
        n_rows = [1 + seqs[b].num_drafted for b in sampled]
        logit_rows = np.concatenate([np.arange(end - r, end) for end, r in zip(logit_rows + 1, n_rows)])
        logit_starts = np.concatenate([[0], np.cumsum(n_rows)[:-1]]).tolist()
    return StepBatch(seqs, counts, tokens, positions, slots // bs, slots % bs, block_tables, context_lens,
                     query_starts, sampled, logit_rows, num_decode, logit_starts)


def decode_batch(seqs: list[Sequence], num_pool_blocks: int, block_size: int) -> StepBatch:
    """prepare_batch's batch when every sequence runs one decode row (the token it sampled last): the same arrays,
    built from Python lists with a few NumPy calls and checked in plain Python.

    Why a second way to build them: the general path makes ~40 small NumPy calls (per sequence, then the checks),
    and a decode step runs them right after its kernel has streamed the weights through the caches, so each runs
    cold; at batch 1 that was a few percent of the step (docs/performance.md, "The Python around a decode step").
    tests/test_step_batch.py checks that both ways build the same batch."""
    bs, B = block_size, len(seqs)
    pos = [seq.num_computed_tokens for seq in seqs]                # each new row's position: the K/V so far
    tables = [seq.block_table for seq in seqs]
    for b, (table, p) in enumerate(zip(tables, pos)):              # what check_block_tables checks, for one row
        used = table[:p // bs + 1]                                 # the blocks positions 0..p live in
        if len(used) <= p // bs or min(used) < 0 or max(used) >= num_pool_blocks:
            raise ValueError(f"paged_attention: sequence {b} has context_len {p + 1} = {p // bs + 1} blocks of "
                             f"{bs}, but its block table starts {used} (needs {p // bs + 1} valid ids in "
                             f"[0, {num_pool_blocks}))")
    width = max(map(len, tables))
    positions = np.array(pos, dtype=np.int64)                                                # [B]
    return StepBatch(seqs, [1] * B,
                     np.array([seq.output_ids[-1] for seq in seqs], dtype=np.int64),         # [B] tokens
                     positions,
                     np.array([t[p // bs] for t, p in zip(tables, pos)], dtype=np.int64),    # [B] write_blocks
                     positions % bs,                                                         # [B] write_offsets
                     np.array([t + [-1] * (width - len(t)) for t in tables], dtype=np.int64),  # [B, max_blocks]
                     positions + 1,                                                          # [B] context_lens
                     np.arange(B + 1, dtype=np.int64),                                       # [B+1] query_starts
                     list(range(B)), np.arange(B, dtype=np.int64), B)                        # every row samples
