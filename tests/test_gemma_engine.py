"""Lesson 11 at the issue's scale, on the real Gemma 3 270M on the fast path (tiles + the windowed Numba attention).

A 3,000-token prompt plus 200 new tokens through the paged engine: the local layers' blocks in use between steps stay
at the window's size (printed) while the global ones grow with the context, and the greedy tokens equal a run that
keeps every block and a run with prefix caching on (the second time, a hit). On the quantised fast path every step
but attention is per row and attention adds in one order (kernels/key_chunks.py), so "equal" is bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

from tinyserve.engine import Engine
from tinyserve.kv_sizing import blocks_for
from tinyserve.sampling import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.real]

BS, N_PROMPT, N_NEW = 16, 3000, 200


def run(model, prompt, free=True, caching=False, repeat=1):
    """Greedy tokens of `prompt` (repeat times on one engine) and the local blocks the running request holds
    between steps (the cache's own twins not counted: they sit in otherwise free blocks)."""
    engine = Engine(model, num_blocks=blocks_for(N_PROMPT + N_NEW, BS) * 2 + 8, block_size=BS, max_batch_tokens=512,
                    prefix_caching=caching)
    engine.blocks.free_behind_window = free
    params = SamplingParams(temperature=0, max_new_tokens=N_NEW, ignore_eos=True)
    outs, held = [], []
    for _ in range(repeat):
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
            held.extend(sum(b >= 0 for b in seq.local_table) for seq in engine.running)
        outs.append(engine.finished[rid].output_ids)
    return outs, held, engine


def test_gemma_3000_plus_200_window_blocks_and_prefix_cache(gemma_fast):
    cfg = gemma_fast.config
    W = cfg.sliding_window
    prompt = [int(t) for t in np.random.default_rng(0).integers(1000, 200000, size=N_PROMPT)]
    (freed,), held, _ = run(gemma_fast, prompt)
    (kept,), held_all, _ = run(gemma_fast, prompt, free=False)
    most = blocks_for(W - 1, BS) + 1
    print(f"\nGemma 3 270M, {N_PROMPT} + {N_NEW} tokens, blocks of {BS}: local blocks held between steps at most "
          f"{max(held)} (window {W} = {W // BS} blocks; bound {most}); keeping every block: {max(held_all)}")
    assert max(held) <= most and max(held_all) == blocks_for(N_PROMPT + N_NEW - 1, BS)
    assert freed == kept and len(freed) == N_NEW
    (first, second), _, engine = run(gemma_fast, prompt, caching=True, repeat=2)
    hits = [h for h, _ in engine.blocks.hits.values()]
    print(f"prefix cache: prompt tokens served from the cache per run {hits}")
    assert first == freed and second == freed
    assert hits[0] == 0 and hits[1] > 0
