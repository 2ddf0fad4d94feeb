"""Lesson 6 exercises: speculative decoding. Replace each `raise NotImplementedError(...)`, then run `make check-6`.

The reference answers are in tinyserve/speculative.py: try first, peek later. Shapes use the legend of
tinyserve/config.py (V vocabulary; k draft tokens; bs block size).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

# The pieces you may build on: the sampling distribution p, greedy choice, a one-number draw, the block allocator.
from tinyserve.drafters import draw  # noqa: F401  (draw(probs [V], rng) -> one token id; probs need not sum to 1)
from tinyserve.kv_sizing import blocks_for  # noqa: F401
from tinyserve.paged import BlockAllocator  # noqa: F401
from tinyserve.sampling import SamplingParams, probabilities, sample  # noqa: F401


def verify_greedy(logits: np.ndarray, draft: Sequence[int], params: SamplingParams,
                  seen: Sequence[int] = ()) -> list[int]:
    """Greedy verification: the accepted prefix of `draft` plus one token of the target's.

    logits: [k + 1, V], row i = the target's logits after the context (`seen`) + draft[:i]; draft: [k] token ids.
    Accept draft[i] while it equals the target's greedy choice at row i; the first disagreement is replaced by the
    target's token and ends the step; if all k agree, row k gives a bonus token. Returns 1 .. k + 1 tokens.
    """
    raise NotImplementedError(
        "verify_greedy: row i is the target's opinion after the context plus draft[:i]. What is its greedy "
        "choice (which helper above already applies the repetition penalty, and which tokens must that penalty "
        "see by row i)? When does the step end, and which token does it end with, in both cases: a disagreement, "
        "and all k agreeing? What should happen for the wrong number of rows, or params that are not greedy?")


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
        "verify_stochastic: accepting x with probability min(1, p(x)/q(x)) gives every token min(p, q) of "
        "probability. How much is each token then still missing from p, and what distribution must a rejection "
        "draw from to supply exactly that? (Drawing from p again is the classic mistake: why?) What is q for a "
        "drafter that gives no draft_probs, what context does p_i see, and which shapes should you refuse?")


def rewind_blocks(block_table: list[int], num_tokens: int, n: int, block_size: int,
                  allocator: BlockAllocator) -> list[int]:
    """Drop the last n of a paged sequence's num_tokens positions; returns the blocks it let go of.

    The table keeps the blocks_for(num_tokens - n) blocks that still hold a kept position (a partly kept block
    stays: its stale tail is overwritten by the next append, and attention never reads past the context length);
    every later block is removed from the table and decref'd (freed, unless another owner still holds it).
    Edits `block_table` in place. n = 0 is a no-op; n = num_tokens empties the table.
    """
    raise NotImplementedError(
        "rewind_blocks: after the rewind, how many blocks still hold at least one kept position (and is a block "
        "that is only partly kept one of them)? The later ones leave the table, in place: but another owner (the "
        "prefix trie, a fork) may still hold one, so what do you call instead of freeing it? Which values of "
        "num_tokens and n make no sense for this table?")
