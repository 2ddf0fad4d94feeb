"""queueing.py: the roofline step time and the Little's-law fixed point, checked against hand-computed values."""
from __future__ import annotations

import pytest

from tinyserve.config import ModelConfig
from tinyserve.queueing import (decode_step_seconds, interleave_budget, num_parameters, predict_load,
                                prefill_seconds_per_token, step_with_prefill)

SMOLLM2 = ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152,
                      max_seq_len=8192)


def test_parameter_count_is_smollm2s():
    assert num_parameters(SMOLLM2) == 134_515_008      # the published 134.5 M (tied embedding counted once)


def test_decode_step_reads_the_weights_once_and_each_sequences_kv():
    bw = 10e9
    w = 134_515_008 * 4
    assert decode_step_seconds(SMOLLM2, 1, 0, bw) == pytest.approx(w / bw)
    # 100 positions of K/V per sequence: 2 * 30 layers * 3 heads * 64 * 4 bytes = 46080 bytes each
    assert decode_step_seconds(SMOLLM2, 8, 100, bw) == pytest.approx((w + 8 * 100 * 46080) / bw)
    assert decode_step_seconds(SMOLLM2, 8, 100, bw) < 1.1 * decode_step_seconds(SMOLLM2, 1, 100, bw), \
        "at small batch the weights dominate: batching is nearly free"
    assert prefill_seconds_per_token(SMOLLM2, 1e12) == pytest.approx(2 * 134_515_008 / 1e12)
    assert step_with_prefill(0.03, 64, 0.001) == pytest.approx(0.094)


def test_littles_law_fixed_point():
    step = lambda b: 0.02 + 0.002 * b          # noqa: E731  a measured-looking step-time line
    p = predict_load(2.0, 50, 20, step, 0.001)
    assert p.stable
    # L = lambda * W at the fixed point, W = TTFT + (n_out - 1) * t_step(L)
    w = p.ttft + 19 * step(p.batch)
    assert p.batch == pytest.approx(2.0 * w, rel=1e-4) and p.latency == pytest.approx(w, rel=1e-4)
    assert p.itl == pytest.approx(step(p.batch))
    slow = predict_load(0.5, 50, 20, step, 0.001)
    assert slow.batch < p.batch and slow.itl < p.itl
    # capacity: 20 tokens per request at >= 20 ms a step is at most ~2.5 requests/s even at batch 64 (64 / (20 * 0.148))
    over = predict_load(50.0, 50, 20, step, 0.001)
    assert not over.stable and over.ttft == float("inf")


def test_interleave_budget_decodes_first_then_prompts_in_order():
    assert interleave_budget(4, [30, 30], 40) == (4, [30, 6])
    assert interleave_budget(50, [30], 40) == (40, [0])
