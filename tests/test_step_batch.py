"""step_batch.prepare_batch's two ways to one batch: a decode-only step takes decode_batch, every other step
chunk_batch. Both must build the same arrays (same values, same dtypes) and refuse the same broken block tables."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tinyserve import engine as engine_mod
from tinyserve.engine import Engine
from tinyserve.sampling import SamplingParams
from tinyserve.step_batch import chunk_batch, decode_batch, prepare_batch


def assert_same_batch(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, f.name
            assert np.array_equal(x, y), f.name
        else:
            assert x == y, f.name


@pytest.mark.parametrize("block_size,num_blocks,budget,prefix", [(4, 64, 1024, False), (16, 256, 7, False),
                                                                  (2, 24, 1024, True)])
def test_decode_batch_is_chunk_batch(tiny, monkeypatch, block_size, num_blocks, budget, prefix):
    """Every step of runs with mixed prompts, tiny blocks, a tight prefill budget, a pool small enough to preempt,
    prefix caching: whenever a step is decodes only, both ways build the same batch."""
    seen = {"decode": 0, "mixed": 0}

    def both(scheduled, nb, bs):
        batch = prepare_batch(scheduled, nb, bs)
        if all(n == 1 and seq.is_decoding for seq, n in scheduled):
            seen["decode"] += 1
            assert_same_batch(decode_batch([s for s, _ in scheduled], nb, bs), chunk_batch(scheduled, nb, bs))
        else:
            seen["mixed"] += 1
        assert_same_batch(batch, chunk_batch(scheduled, nb, bs))
        return batch

    monkeypatch.setattr(engine_mod, "prepare_batch", both)
    rng = np.random.default_rng(block_size)
    shared = [int(t) for t in rng.integers(3, 256, 9)]
    engine = Engine(tiny, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget,
                    prefix_caching=prefix)
    for i in range(10):             # requests arrive while others decode: steps mix prefills and decodes
        prompt = (shared if prefix else []) + [int(t) for t in rng.integers(3, 256, int(rng.integers(1, 20)))]
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=int(rng.integers(1, 25)),
                                                  ignore_eos=True))
        for _ in range(int(rng.integers(0, 4))):
            engine.step()
    engine.run()
    assert seen["decode"] >= 5 and seen["mixed"] >= 2, seen
    if num_blocks < 32:
        assert any(s.num_preempted for s in engine.stats), "the small pool was meant to preempt"


def test_decode_batch_refuses_what_check_block_tables_refuses(tiny):
    engine = Engine(tiny, num_blocks=16, block_size=4)
    for prompt in ([5, 6, 7, 8, 9], [10, 11]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    engine.step()                                        # both prefill and sample their first token
    scheduled, _, _ = engine._schedule()                 # the next step: two decodes (positions 5 and 2)
    assert all(n == 1 and seq.is_decoding for seq, n in scheduled)
    seqs = [seq for seq, _ in scheduled]
    good = [list(seq.block_table) for seq in seqs]
    for broken in ([good[0][0], 16], [good[0][0], -1], good[0][:1]):   # out of the pool, a hole, too short
        seqs[0].block_table[:] = broken
        for build in (lambda: decode_batch(seqs, 16, 4), lambda: chunk_batch(scheduled, 16, 4)):
            with pytest.raises(ValueError, match="block table"):
                build()
    seqs[0].block_table[:] = good[0]
    assert_same_batch(prepare_batch(scheduled, 16, 4), chunk_batch(scheduled, 16, 4))
