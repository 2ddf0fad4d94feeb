"""Lesson 6 exercises: speculative decoding. Replace each `raise NotImplementedError(...)`, then run `make check-6`.

The reference answers are in tinyserve/speculative.py: try first, peek later. Shapes use the legend of
tinyserve/config.py (V vocabulary; k draft tokens; bs block size).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# The pieces you may build on: the sampling distribution p, greedy choice, a one-number draw, the block allocator.
from tinyserve.drafters import draw  # noqa: F401  (draw(probs [V], rng) -> one token id; probs need not sum to 1)
from tinyserve.paged import BlockAllocator, blocks_for  # noqa: F401
from tinyserve.sampling import SamplingParams, probabilities, sample  # noqa: F401


def verify_greedy(logits: np.ndarray, draft: Sequence[int], params: SamplingParams,
                  seen: Sequence[int] = ()) -> list[int]:
    """Greedy verification: the accepted prefix of `draft` plus one token of the target's.

    logits: [k + 1, V], row i = the target's logits after the context (`seen`) + draft[:i]; draft: [k] token ids.
    Accept draft[i] while it equals the target's greedy choice at row i; the first disagreement is replaced by the
    target's token and ends the step; if all k agree, row k gives a bonus token. Returns 1 .. k + 1 tokens.
    """
    raise NotImplementedError(
        "verify_greedy: for i = 0 .. k, the target's choice at row i is sample(logits[i], params, None, seen=...) "
        "(greedy: an argmax after the repetition penalty, which must see `seen` + the tokens accepted so far). "
        "Append it to the output; stop if i == k or it differs from draft[i]. Raise ValueError if logits does not "
        "have k + 1 rows, or if params are not greedy")


def verify_stochastic(logits: np.ndarray, draft: Sequence[int], draft_probs: np.ndarray | None,
                      params: SamplingParams, rng: np.random.Generator, seen: Sequence[int] = ()) -> list[int]:
    """Stochastic verification (speculative sampling): the output is distributed exactly as the target's.

    logits: [k + 1, V] target logits (row i after seen + draft[:i]); draft: [k]; draft_probs: [k, V] the q each
    draft token was drawn from, or None for a deterministic drafter (q one-hot on its token). p_i is the very
    distribution sampling.sample would draw from (temperature, top-k/p, min-p, repetition penalty).
    Accept draft[i] = x with probability min(1, p_i(x) / q_i(x)); on the first rejection draw from the residual
    max(0, p_i - q_i), normalised, and stop; if all k are accepted, draw a bonus token from p_k.
    """
    raise NotImplementedError(
        "verify_stochastic: for each draft token x at row i, p = probabilities(logits[i], params, seen so far) and "
        "q = draft_probs[i] (or one-hot on x). Accept if rng.random() * q[x] < p[x]; otherwise append "
        "draw(np.maximum(p - q, 0), rng) and return. After k acceptances append draw(p_k, rng). Raise ValueError on "
        "wrong shapes (logits [k + 1, V], draft_probs [k, V])")


def rewind_blocks(block_table: list[int], num_tokens: int, n: int, block_size: int,
                  allocator: BlockAllocator) -> list[int]:
    """Drop the last n of a paged sequence's num_tokens positions; returns the blocks it let go of.

    The table keeps the blocks_for(num_tokens - n) blocks that still hold a kept position (a partly kept block
    stays: its stale tail is overwritten by the next append, and attention never reads past the context length);
    every later block is removed from the table and decref'd (freed, unless another owner still holds it).
    Edits `block_table` in place. n = 0 is a no-op; n = num_tokens empties the table.
    """
    raise NotImplementedError(
        "rewind_blocks: check 0 <= num_tokens <= len(block_table) * block_size and 0 <= n <= num_tokens (ValueError "
        "otherwise); keep = blocks_for(num_tokens - n, block_size); the dropped blocks are block_table[keep:]: "
        "delete them from the table (in place) and allocator.decref each one; return them")
