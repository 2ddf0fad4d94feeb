"""The timed loops every llama.cpp-family worker runs (llama_worker.py, ik_worker.py): greedy decode of B sequences
and one prefill, through the C API both forks share (`llama_batch_init`, `llama_decode`, `llama_get_logits_ith`).

What differs between the forks (how a model is loaded, a context's parameters, how its cache is cleared) stays in
each worker: it hands in `context(n_seq, positions_per_seq, n_batch)`, which returns a context with an empty K/V
cache. Imports NumPy only (each fork's venv has it).
"""
from __future__ import annotations

import time
from typing import Callable

import numpy as np


def greedy_commands(C, n_vocab: int, context: Callable[[int, int, int], object]) -> dict[str, Callable[..., dict]]:
    """The worker's `decode` and `prefill` commands (tools/peers/protocol.py) on the C module `C`."""

    def run_batch(ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """Fill `batch` with (token, position, sequence, wants logits) entries and run llama_decode on it."""
        for i, (tok, pos, seq, logits) in enumerate(entries):
            batch.token[i] = tok
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(logits)
        batch.n_tokens = len(entries)
        rc = C.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(entries)} tokens")

    def next_token(ctx, i: int) -> int:
        """Greedy: argmax of the logits of batch entry i."""
        row = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, i), shape=(n_vocab,))  # [V], no copy
        return int(row.argmax())

    def decode(prompts: list[list[int]], new_tokens: int) -> dict:
        """B prompts prefilled together, then new_tokens - 1 decode steps of B tokens each (one per sequence).
        Only the decode steps are timed: the first new token comes from the prefill's logits."""
        B = len(prompts)
        n_prompt = sum(map(len, prompts))
        ctx = context(B, max(map(len, prompts)) + new_tokens, n_prompt)
        batch = C.llama_batch_init(max(n_prompt, B), 0, 1)
        try:
            entries = [(t, j, b, j == len(p) - 1) for b, p in enumerate(prompts) for j, t in enumerate(p)]
            t0 = time.perf_counter()
            run_batch(ctx, batch, entries)
            last = np.cumsum([len(p) for p in prompts]) - 1                  # [B] batch index of each last token
            out = [[next_token(ctx, int(i))] for i in last]
            prefill_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            for step in range(new_tokens - 1):
                run_batch(ctx, batch, [(out[b][-1], len(p) + step, b, True) for b, p in enumerate(prompts)])
                for b in range(B):
                    out[b].append(next_token(ctx, b))
            decode_s = time.perf_counter() - t0
        finally:
            C.llama_batch_free(batch)
        return {"tokens": out, "decode_seconds": decode_s, "decode_tokens": B * (new_tokens - 1),
                "prefill_seconds": prefill_s}

    def prefill(ids: list[int]) -> dict:
        """One prompt in one llama_decode, logits for its last position only; timed up to that token."""
        ctx = context(1, len(ids), len(ids))
        batch = C.llama_batch_init(len(ids), 0, 1)
        try:
            entries = [(t, j, 0, j == len(ids) - 1) for j, t in enumerate(ids)]
            t0 = time.perf_counter()
            run_batch(ctx, batch, entries)
            tok = next_token(ctx, len(ids) - 1)
            seconds = time.perf_counter() - t0
        finally:
            C.llama_batch_free(batch)
        return {"seconds": seconds, "next_token": tok}

    return {"decode": decode, "prefill": prefill}


def quiet_log(callback_type, keep: list):
    """A llama.cpp log callback that keeps warnings and errors (ggml levels WARN=3, ERROR=4) and drops the rest;
    level 5 (CONT) continues the previous message, so it follows that message's fate. `keep` holds the ctypes
    callback: it must outlive the C library's use of it."""
    import sys
    shown = [True]

    def log(level: int, text: bytes, _user_data) -> None:
        shown[0] = shown[0] if level == 5 else level >= 3
        if shown[0]:
            sys.stderr.write(text.decode(errors="replace"))

    keep.append(callback_type(log))
    return keep[-1]
