"""Lesson 8 exercises: the load prediction (Little's law over the step time), the wire format of a token stream (SSE
framing, stop strings held back), the interleaved design's per-step budget, and the K/V hand-over of the
disaggregated design.

Replace each `raise NotImplementedError(...)` with your code, then run `make check-8`: it runs the checks in
tests/lessons/test_lesson_08.py against this file and tells you, exercise by exercise, what passes.
The reference answers live in tinyserve/queueing.py, tinyserve/protocol.py and tinyserve/orchestrators.py: try
first, compare after.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from tinyserve.queueing import LoadPrediction  # noqa: F401  (what predict_load returns)


def predict_load(rate: float, prompt_tokens: float, output_tokens: float, step_seconds: Callable[[float], float],
                 prefill_per_token: float, max_batch: float = 64, iters: int = 200) -> LoadPrediction:
    """The batch a server settles at under `rate` requests/s, and the latencies that follow (the notebook's capacity).

    Little's law: B = rate * W, where W is the time one request spends in the system,
        W = TTFT + (output_tokens - 1) * t_step(B),   TTFT = t_step(B) / 2 + t_step(B) + prompt_tokens * prefill_per_token
    (a request arrives on average half a step before the next boundary, waits that step, then pays its prefill).
    step_seconds(B) is the decode step time at batch B, and it grows with B: B appears on both sides. Find the B
    where they agree, starting from B = 1 and within `iters` rounds. Return LoadPrediction(rate, B, t_step(B),
    TTFT, itl = t_step(B), stable=True). If the batch the law asks for ever exceeds max_batch, the server cannot
    drain the arrivals: return LoadPrediction(rate, max_batch, t_step(max_batch), inf, t_step(max_batch), False).
    """
    raise NotImplementedError(
        "predict_load: B is on both sides of B = rate * W(B). Guess a B, compute the W it implies, and the B that W "
        "implies in turn: does repeating that settle? (If it oscillates, what does averaging the old and new guess "
        "do?) When should you stop, and what does it mean if the batch keeps growing past max_batch?")


def sse_event(data: dict | str) -> str:
    """One server-sent event carrying `data`: a dict is sent as compact JSON (separators "," and ":", non-ASCII
    escaped: json.dumps' default), a str (e.g. "[DONE]") as is.

    The frame is `data: <payload>` followed by a blank line, i.e. "data: <payload>\\n\\n". A payload containing a
    newline (CR or LF) cannot be one data line: raise ValueError.
    """
    raise NotImplementedError(
        "sse_event: which separators make json.dumps compact, and does its default keep non-ASCII characters "
        "(why does that matter to a client that splits lines)? A frame ends where? What would a newline inside "
        "the payload do to a client reading line by line?")


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many characters at the end of `text` a stream must hold back because they could still become a stop
    string: the length of the longest tail of `text` that is a *proper* prefix of one of `stops` (0 if none).

    A complete stop string is not held back (the caller finds it and cuts the text there); only its beginnings are.
    E.g. held_back("the END", ("END",)) == 0 (complete: found, not held), held_back("the EN", ("END",)) == 2.
    """
    raise NotImplementedError(
        "held_back: which tails of the text could still grow into a stop string? Try the beginnings of each stop "
        "(but not the whole stop: why not?), longest first. With several stops, which one decides?")


def interleave_budget(num_decoding: int, prefill_remaining: Sequence[int], token_budget: int
                      ) -> tuple[int, list[int]]:
    """One interleaved step's token budget. Decodes first, one token each (at most token_budget of them run); the
    rest goes to the waiting prompts in arrival order, each taking up to its remaining prompt tokens.

    Returns (decodes that run, [tokens for each prompt in prefill_remaining]).
    """
    raise NotImplementedError(
        "interleave_budget: who goes first, and why should a running request's next token never wait behind a "
        "prompt? What is left for the prompts, and how do you hand it out so that no prompt overtakes an earlier "
        "one? What if the budget cannot even cover the decodes?")


def export_kv(engine, seq, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V of positions 0 .. num_positions-1 of a running sequence, gathered from the engine's paged
    pool into two contiguous arrays [L, P, K, H] (what the prefill worker copies into shared memory).

    engine.pool.k / engine.pool.v are [L, num_blocks, bs, K, H]; seq.block_table[i] is the physical block holding
    positions i*bs .. i*bs+bs-1; engine.block_size is bs. Only the blocks that hold the P positions are read.
    """
    raise NotImplementedError(
        "export_kv: how many blocks hold positions 0 .. P-1, and which entries of the block table are they? NumPy "
        "can index the pool's block axis with a list of block ids: what shape comes out, how do you merge the "
        "block and in-block axes into one position axis, and what do you do with the tail of the last block?")
