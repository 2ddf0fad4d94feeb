"""Tensor parallelism simulated over P devices: the same logits and greedy tokens as the single-device model, and
exactly the bytes the formula says cross the (simulated) links."""
from __future__ import annotations

import numpy as np
import pytest

from tinyserve import kv_cache as kc, roofline as rf
from tinyserve.sampling import SamplingParams
from tinyserve.tensor_parallel import Link, TensorParallelModel, all_gather, all_reduce

GREEDY = SamplingParams(temperature=0, ignore_eos=True)


def assert_same_logits(got, ref):
    # Row-parallel matmuls sum the same products in another order: float32 rounding only. Measured on SmolLM2,
    # P=3, 20-token prefill: |TP - single| / |single| = 2.6e-6 (Frobenius), where float32 vs float64 is 1.2e-6.
    assert got.shape == ref.shape
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [12, 7])                     # divisible by P or not: chunks of unequal size
def test_ring_all_reduce_sums_and_counts_bytes(P, n):
    rng = np.random.default_rng(P * 10 + n)
    parts = [rng.standard_normal((3, n)).astype(np.float32) for _ in range(P)]
    link = Link()
    out = all_reduce(parts, link)
    assert len(out) == P
    for o in out:
        np.testing.assert_allclose(o, np.sum(parts, axis=0), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(o, out[0])           # every device holds the very same numbers
    # each device sends each of the P chunks twice over P - 1 steps... in all 2 * (P - 1) chunks per device
    assert link.messages == 2 * (P - 1) * P
    assert link.bytes_sent == 2 * (P - 1) * parts[0].nbytes


def test_all_reduce_does_not_modify_its_inputs():
    parts = [np.full((2, 6), float(d), np.float32) for d in range(3)]
    all_reduce(parts, Link())
    assert [float(p[0, 0]) for p in parts] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("P", [1, 2, 3])
def test_ring_all_gather(P):
    parts = [np.full((2, 4 + d), d, np.float32) for d in range(P)]
    link = Link()
    out = all_gather(parts, link)
    for o in out:
        np.testing.assert_array_equal(o, np.concatenate(parts, axis=-1))
    assert link.bytes_sent == (P - 1) * sum(p.nbytes for p in parts)


def test_shard_refuses_a_split_of_kv_heads(tiny):
    with pytest.raises(ValueError, match="KV heads"):
        TensorParallelModel.shard(tiny, 3)                 # K = 2


def test_devices_hold_one_share_of_the_weights_each(tiny):
    tp = TensorParallelModel.shard(tiny, 2)
    single = TensorParallelModel.shard(tiny, 1).devices[0].nbytes()
    assert sum(d.nbytes() for d in tp.devices) == single
    assert tp.devices[0].nbytes() == tp.devices[1].nbytes() == single // 2


def check_model(model, P, prompt_len=12, decode_steps=3, new_tokens=8):
    cfg = model.config
    ids = np.random.default_rng(P).integers(3, cfg.vocab_size, prompt_len).tolist()
    tp = TensorParallelModel.shard(model, P)
    tp.allocate_caches(prompt_len + decode_steps)
    cache = kc.KVCache.allocate(cfg, prompt_len + decode_steps)
    assert_same_logits(tp.forward(ids, all_logits=True), kc.forward_with_cache(model, cache, ids, all_logits=True))
    shape = rf.ModelShape.from_config(cfg)
    # prefill: every one of the prompt's tokens crosses the layers' all-reduces; all_logits gathers every row
    expected = prompt_len * rf.tensor_parallel_bytes_per_token(shape, P, 4)
    assert tp.link.bytes_sent == expected
    for step in range(decode_steps):
        before = tp.link.bytes_sent
        token = [int(ids[step])]
        assert_same_logits(tp.forward(token), kc.forward_with_cache(model, cache, token))
        assert tp.link.bytes_sent - before == rf.tensor_parallel_bytes_per_token(shape, P, 4)
    # the KV cache is laid out per device: K/P heads each, together exactly the single-device cache
    assert all(d.cache.k.shape[2] == cfg.n_kv_heads // P for d in tp.devices)
    np.testing.assert_allclose(np.concatenate([d.cache.k for d in tp.devices], axis=2), cache.k, rtol=1e-4, atol=1e-4)
    assert tp.generate(ids, new_tokens) == kc.generate(model, ids, new_tokens, GREEDY)


@pytest.mark.parametrize("P", [1, 2])
def test_tiny_model_tensor_parallel_matches_single_device(tiny, P):
    check_model(tiny, P)


@pytest.mark.real
@pytest.mark.parametrize("P", [1, 3])
def test_smollm2_tensor_parallel_matches_single_device(smol, P):
    check_model(smol, P, prompt_len=8, decode_steps=1, new_tokens=4)


def test_bytes_per_token_formula_by_hand():
    smol = rf.ModelShape(30, 576, 1536, 9, 3, 64, 49152)
    # 30 layers x 2 all-reduces x 2 * (3 - 1) * 576 values x 4 B, + the logits: (3 - 1) * 49152 * 4 B
    assert rf.tensor_parallel_bytes_per_token(smol, 3, 4) == 30 * 2 * 2 * 2 * 576 * 4 + 2 * 49152 * 4 == 946_176
    assert rf.tensor_parallel_bytes_per_token(smol, 3, 2, logits=False) == 276_480
    assert rf.tensor_parallel_bytes_per_token(smol, 1, 4) == 0


def test_clear_errors_on_misuse(tiny):
    with pytest.raises(ValueError, match="one shape"):
        all_reduce([np.zeros(4, np.float32), np.zeros(5, np.float32)], Link())
    with pytest.raises(ValueError, match="one array per device"):
        all_reduce([], Link())
    with pytest.raises(ValueError, match="last axis"):
        all_gather([np.zeros((2, 4)), np.zeros((3, 4))], Link())
    tp = TensorParallelModel.shard(tiny, 2)
    with pytest.raises(ValueError, match="allocate_caches"):
        tp.forward([1, 2])
    with pytest.raises(ValueError, match="context window"):
        tp.allocate_caches(tiny.config.max_seq_len + 1)
    tp.allocate_caches(4)
    with pytest.raises(ValueError, match="out of range"):
        tp.forward([tiny.config.vocab_size])
    with pytest.raises(ValueError, match="full"):
        tp.forward([1, 2, 3, 4, 5])
