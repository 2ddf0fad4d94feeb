"""Lesson 9 self-checks: the calculator for inference at scale, and the ring all-reduce of tensor parallelism.

`make check-9` runs these against lessons/09_scale/exercises.py; `make test` runs them against tinyserve.
The expected numbers are worked out by hand in the comments (GB = 1e9 bytes): the worked problems of the lesson.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.lessons.impl import load_impl
from tinyserve.roofline import TPU_V5E, Chip
from tinyserve.tensor_parallel import Link

REFERENCE = {
    "ModelShape": "tinyserve.roofline:ModelShape",
    "critical_batch": "tinyserve.roofline:critical_batch",
    "decode_step_time": "tinyserve.roofline:decode_step_time",
    "max_batch": "tinyserve.roofline:max_batch",
    "largest_batch_within": "tinyserve.roofline:largest_batch_within",
    "disaggregated_rates": "tinyserve.roofline:disaggregated_rates",
    "all_reduce": "tinyserve.tensor_parallel:all_reduce",
}
impl = load_impl(9, REFERENCE)

V5E = TPU_V5E                      # 16 GB HBM, 8.1e11 B/s, 1.97e14 bf16 FLOP/s
approx = lambda x: pytest.approx(x, rel=1e-9)  # noqa: E731  float formulas: exact up to rounding


def model_18b(n_kv_heads=8, **kw):
    # 64 layers, d_model 4096, d_ff 16384, 32 query heads of dim 256, vocab 32128, tied embeddings
    return impl.ModelShape(64, 4096, 16384, 32, n_kv_heads, 256, 32128, **kw)


# --- ModelShape ------------------------------------------------------------------------------------------------

@pytest.mark.exercise("ModelShape")
def test_params_of_the_18b_model():
    # per layer: attention 2 * D * H * (N + K) = 2 * 4096 * 256 * 40 = 83,886,080
    #            MLP 3 * D * F = 3 * 4096 * 16384 = 201,326,592
    # 64 layers: 18,253,611,008; + tied embedding 32128 * 4096 = 131,596,288
    assert model_18b().params() == 18_385_207_296
    assert model_18b().active_params() == 18_385_207_296           # dense: every token uses every weight
    assert model_18b(tied_embeddings=False).params() == 18_385_207_296 + 131_596_288


@pytest.mark.exercise("ModelShape")
def test_kv_bytes_per_token_of_the_18b_model():
    assert model_18b().kv_bytes_per_token(1) == 262_144             # int8: 2 * 64 * 8 * 256
    assert model_18b().kv_bytes_per_token(2) == 524_288             # bf16
    assert model_18b().kv_bytes_per_token() == 524_288, "the default bytes_per_value is 2 (bf16)"
    assert model_18b(n_kv_heads=1).kv_bytes_per_token(1) == 32_768  # one KV head: 8x less


@pytest.mark.exercise("ModelShape")
def test_moe_total_and_active_params():
    moe = model_18b(n_experts=16, experts_per_token=2)
    # 64 * (83,886,080 + 16 * 201,326,592) + 131,596,288
    assert moe.params() == 211_658_735_616
    # 64 * (83,886,080 + 2 * 201,326,592) + 131,596,288
    assert moe.active_params() == 31_270_109_184


@pytest.mark.exercise("ModelShape")
def test_smollm2_shape_matches_the_real_model_count():
    smol = impl.ModelShape(30, 576, 1536, 9, 3, 64, 49152)
    # Model.num_parameters() = 134,515,008 including 30 * 2 * 576 + 576 = 35,136 norm weights
    assert smol.params() in (134_479_872, 134_515_008)
    assert smol.kv_bytes_per_token(4) == 46_080


# --- critical batch and step time ------------------------------------------------------------------------------

@pytest.mark.exercise("critical_batch")
def test_critical_batch_v5e():
    assert impl.critical_batch(V5E, 2) == approx(1.97e14 / 8.1e11)          # bf16 weights: ~243
    assert impl.critical_batch(V5E, 1) == approx(1.97e14 / 8.1e11 / 2)      # int8 weights: ~122
    # MoE, 16 experts, 2 active: each expert sees 2/16 of the batch's tokens -> 8x the batch, ~1946 in bf16
    assert impl.critical_batch(V5E, 2, 16, 2) == approx(8 * 1.97e14 / 8.1e11)


@pytest.mark.exercise("decode_step_time")
def test_time_to_read_the_18b_weights_once():
    # int8 weights over 16 chips: 18,385,207,296 B / (16 * 8.1e11 B/s) = 1.42 ms; batch 1's FLOPs are far less
    params = 18_385_207_296
    assert impl.decode_step_time(V5E, 16, 1, params, 0, 1) == approx(params / (16 * 8.1e11))


@pytest.mark.exercise("decode_step_time")
def test_step_time_two_regimes_plus_kv():
    chip = Chip("round numbers", 1e10, 1e12, 1e14)           # critical batch at bf16: 100
    P = 1e9
    # memory-bound: weights 2e9 B / 1e12 = 2 ms whatever the batch, FLOPs at B=10 only 2e9*10/1e14 = 0.2 ms
    assert impl.decode_step_time(chip, 1, 10, P, 0, 2) == approx(2e-3)
    # compute-bound: B=400 -> 2e9 * 400 / 1e14 = 8 ms > 2 ms
    assert impl.decode_step_time(chip, 1, 400, P, 0, 2) == approx(8e-3)
    # the KV read adds on top: 10 sequences of 1e8 B = 1e9 B / 1e12 = 1 ms; over 4 chips with kv_shards=2: 1/2
    assert impl.decode_step_time(chip, 1, 10, P, 1e8, 2) == approx(3e-3)
    assert impl.decode_step_time(chip, 4, 10, P, 1e8, 2, kv_shards=2) == approx(0.5e-3 + 0.5e-3)
    assert impl.decode_step_time(chip, 4, 10, P, 1e8, 2) == approx(0.5e-3 + 0.25e-3)   # default: all 4 chips


@pytest.mark.exercise("decode_step_time")
def test_step_time_compute_bound_with_kv_on_fewer_shards():
    # non-round numbers, a compute-bound step AND a KV read, the cache on 3 of 6 chips (3 KV heads, replicated twice)
    chip = Chip("odd", 1e10, 7e11, 3.3e13)
    P, B, kv_seq = 1.3e9, 37, 2.7e7
    weights = P * 1.5 / (6 * 7e11)                 # 0.464 ms: each chip reads its sixth of the weights
    flops = 2 * P * B / (6 * 3.3e13)               # 0.486 ms: the matmuls bind (compute-bound)
    kv = B * kv_seq / (3 * 7e11)                   # 0.476 ms: each of the 3 KV shards reads a third of the cache
    assert flops > weights
    got = impl.decode_step_time(chip, 6, B, P, kv_seq, 1.5, kv_shards=3)
    assert got == approx(flops + kv), (
        f"{got * 1e3:.4f} ms: the KV read adds to the max(weights, matmuls) even when the matmuls bind, and the "
        f"cache is split over kv_shards = 3 chips, the weights over all 6: {flops * 1e3:.4f} + {kv * 1e3:.4f} ms")


KV70 = 2 * 80 * 8 * 128             # 70B model, int8 KV: 163,840 B per token


@pytest.mark.exercise("decode_step_time")
def test_70b_step_time_at_8192_context():
    kv_seq = 8192 * KV70             # 1,342,177,280 B per request
    w = 70e9 / (16 * 8.1e11)         # 5.40 ms of weights per chip
    assert impl.decode_step_time(V5E, 16, 1, 70e9, kv_seq, 1) == approx(w + kv_seq / (16 * 8.1e11))
    assert impl.decode_step_time(V5E, 16, 64, 70e9, kv_seq, 1) == approx(w + 64 * kv_seq / (16 * 8.1e11))


# --- capacity and latency bounds on the batch ------------------------------------------------------------------

@pytest.mark.exercise("max_batch")
def test_18b_largest_batch_at_128k_on_16_v5e():
    # free per chip: 16e9 - 18,385,207,296 / 16 = 14,850,924,544 B
    # KV per sequence per chip: 131072 * 262,144 / 16 = 2,147,483,648 B -> 6.9 -> 6 sequences
    assert impl.max_batch(V5E, 16, 131072, 18_385_207_296, 262_144, 1) == 6
    # one KV head: params 64 * (2*4096*256*33 + 201,326,592) + 131,596,288 = 17,445,683,200
    # free 16e9 - 1,090,355,200 = 14,909,644,800; per chip 131072 * 32768 / 16 = 268,435,456 -> 55.5 -> 55
    assert impl.max_batch(V5E, 16, 131072, 17_445_683_200, 32_768, 1) == 55
    # ...but one KV head cannot be split 16 ways: each chip holds a replica (kv_shards=1): 4,294,967,296 -> 3
    assert impl.max_batch(V5E, 16, 131072, 17_445_683_200, 32_768, 1, kv_shards=1) == 3


@pytest.mark.exercise("max_batch")
def test_70b_capacity_with_2gb_reserved():
    # free per chip: 16e9 - 2e9 - 70e9 / 16 = 9.625e9 B
    assert impl.max_batch(V5E, 16, 8192, 70e9, KV70, 1, reserved_bytes=2e9) == 114    # 9.625e9 / 83,886,080
    assert impl.max_batch(V5E, 16, 2048, 70e9, KV70, 1, reserved_bytes=2e9) == 458    # 9.625e9 / 20,971,520
    assert impl.max_batch(V5E, 4, 2048, 70e9, KV70, 1) == 0                          # 17.5 GB per chip: no room

@pytest.mark.exercise("max_batch")
def test_max_batch_at_the_edges_on_a_toy_chip():
    # a 1000-byte chip: the boundaries are exact, so a byte too many or too few, and each rounding, shows
    toy = Chip("toy", hbm_bytes=1000, hbm_bandwidth=1, flops=1)
    assert impl.max_batch(toy, 1, 10, 500, 5, 1) == 10, "500 B left, 50 B per sequence: exactly 10 fit (default: nothing reserved)"
    assert impl.max_batch(toy, 1, 10, 500.5, 5, 1) == 9, "499.5 B left: the 10th sequence does not fit"
    assert impl.max_batch(toy, 1, 10, 250, 5, 2) == 10, "bf16 weights: 250 params x 2 bytes"
    assert impl.max_batch(toy, 3, 10, 1502, 5, 1, kv_shards=1) == 9, "each of 3 chips holds 1502 / 3 = 500.67 B of weights (not 500)"
    assert impl.max_batch(toy, 3, 10, 150, 2, 1, kv_shards=3) == 142, "950 B / (10 x 2 / 3 B per sequence per chip)"
    assert impl.max_batch(toy, 1, 1, 999, 1, 1) == 1, "1 B left, a 1-byte sequence: it fits"
    assert impl.max_batch(toy, 2, 10, 2001, 5, 1) == 0, "1000.5 B of weights per chip: half a byte too many, 0 (never < 0)"


@pytest.mark.exercise("largest_batch_within")
def test_70b_batch_under_12ms_at_8192_context():
    # memory-bound branch: (12 ms - 5.401 ms) / (83,886,080 B / 8.1e11 B/s = 0.10356 ms) = 63.7
    # compute-bound branch: 12 ms / (2 * 70e9 / (16 * 1.97e14) + 0.10356 ms = 0.14798 ms) = 81.1 -> 63
    B = impl.largest_batch_within(V5E, 16, 12e-3, 70e9, 8192 * KV70, 1)
    assert B == 63
    # throughput: 63 tokens per step of 5.401 + 63 * 0.10356 = 11.93 ms -> ~5280 tokens/s
    step = 70e9 / (16 * 8.1e11) + 63 * 8192 * KV70 / (16 * 8.1e11)
    assert B / step == pytest.approx(5283, rel=1e-3)


@pytest.mark.exercise("largest_batch_within")
def test_70b_batch_under_12ms_at_2048_context_is_compute_bound():
    # memory-bound branch would allow (12 - 5.401) / 0.025891 = 254.9, but at that batch the FLOPs take
    # 254 * 0.044416 = 11.3 ms > 5.4 ms: the compute-bound branch binds: 12 / (0.044416 + 0.025891) = 170.7
    assert impl.largest_batch_within(V5E, 16, 12e-3, 70e9, 2048 * KV70, 1) == 170
    assert impl.largest_batch_within(V5E, 16, 5e-3, 70e9, 2048 * KV70, 1) == 0      # the weights alone: 5.4 ms

@pytest.mark.exercise("largest_batch_within")
def test_largest_batch_within_on_a_toy_chip():
    # 1 B/s, 1000 FLOP/s: w = params * bytes / n_chips seconds, c = 2 * params / (n_chips * 1000), k = kv / kv_shards
    toy = Chip("toy", hbm_bytes=1e9, hbm_bandwidth=1, flops=1000)
    assert impl.largest_batch_within(toy, 1, 100, 10, 5, 2) == 16, "bf16: w = 20 s, (100 - 20) / 5 = 16"
    assert impl.largest_batch_within(toy, 1, 20, 10, 0, 2) == 1000, (
        "no KV read and a step exactly as long as the weight read: the FLOPs bound, 20 / 0.02 = 1000")
    # 4 chips share the weights, but the KV cache lives whole on each (kv_shards=1: one KV head, replicated):
    # w = 10 * 2 / 4 = 5 s, k = 3 / 1 = 3 s per sequence, c = 2 * 10 / 4000 = 0.005 s -> min(95 / 3, 100 / 3.005)
    assert impl.largest_batch_within(toy, 4, 100, 10, 3, 2, kv_shards=1) == 31, (
        "the weights split 4 ways (5 s), the KV read not split at all (kv_shards=1: 3 s a sequence): (100 - 5) / 3")
    assert impl.largest_batch_within(toy, 4, 100, 10, 3, 2, kv_shards=2) == 63, "(100 - 5) / (3 / 2) = 63.3"


# --- disaggregated serving -------------------------------------------------------------------------------------

@pytest.mark.exercise("disaggregated_rates")
def test_disaggregated_prefill_decode_and_link_rates():
    # 70B int8 on 16 + 16 v5e, prompt 8192, output 512, decode batch 32, a 45 GB/s link between the groups
    r = impl.disaggregated_rates(V5E, 16, 16, 8192, 512, 32, 70e9, KV70, 1, 4.5e10)
    # prefill: 2 * 70e9 * 8192 FLOPs / (16 * 1.97e14) = 0.3639 s -> 2.75 requests/s
    assert r.prefill == approx(16 * 1.97e14 / (2 * 70e9 * 8192))
    # decode: mean context 8192 + 256 = 8448 -> 1,384,120,320 B per sequence;
    # step = 5.401 ms + 32 * 1,384,120,320 / (16 * 8.1e11) = 8.819 ms; 32 requests per 512 steps -> 7.09 requests/s
    step = 70e9 / (16 * 8.1e11) + 32 * 8448 * KV70 / (16 * 8.1e11)
    assert r.decode == approx(32 / (512 * step))
    # link: 4.5e10 / 1,342,177,280 B per hand-over = 33.5 requests/s
    assert r.handover == approx(4.5e10 / (8192 * KV70))
    assert min(r.prefill, r.decode, r.handover) == r.prefill       # this deployment needs more prefill chips

@pytest.mark.exercise("disaggregated_rates")
def test_disaggregated_decode_rate_with_an_odd_output_length():
    r = impl.disaggregated_rates(V5E, 16, 16, 8192, 511, 32, 70e9, KV70, 1, 4.5e10)
    step = 70e9 / (16 * 8.1e11) + 32 * (8192 + 255.5) * KV70 / (16 * 8.1e11)
    assert r.decode == approx(32 / (511 * step)), "the mean context is prompt_len + output_len / 2 = 8447.5 (not 8447)"


@pytest.mark.exercise("disaggregated_rates")
def test_disaggregated_unequal_groups_and_a_short_prompt():
    # 8 prefill chips, 24 decode chips, a 100-token prompt: its FLOPs 2 * 70e9 * 100 / (8 * 1.97e14) = 8.88 ms take
    # less than reading the weights once, 70e9 / (8 * 8.1e11) = 10.80 ms: a short prefill is memory-bound
    r = impl.disaggregated_rates(V5E, 8, 24, 100, 37, 20, 70e9, KV70, 1, 4.5e10)
    assert r.prefill == approx(8 * 8.1e11 / 70e9), (
        f"prefill {r.prefill:.2f}/s: a prefill is at least one weight read (10.80 ms on 8 chips), not only its FLOPs")
    step = 70e9 / (24 * 8.1e11) + 20 * (100 + 18.5) * KV70 / (24 * 8.1e11)
    assert r.decode == approx(20 / (37 * step)), "the decode group has its own 24 chips (not the prefill group's 8)"
    assert r.handover == approx(4.5e10 / (100 * KV70))


# --- the ring all-reduce ---------------------------------------------------------------------------------------

@pytest.mark.exercise("all_reduce")
@pytest.mark.parametrize("P", [2, 3, 4])
def test_all_reduce_sums_on_every_device(P):
    rng = np.random.default_rng(P)
    parts = [rng.standard_normal((2, 12)).astype(np.float32) for _ in range(P)]
    kept = [p.copy() for p in parts]
    out = impl.all_reduce(parts, Link())
    assert len(out) == P
    for o in out:
        np.testing.assert_allclose(o, np.sum(kept, axis=0), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(o, out[0])       # every device must end with the very same numbers
    for p, k in zip(parts, kept):
        np.testing.assert_array_equal(p, k)            # and the inputs are left alone


@pytest.mark.exercise("all_reduce")
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_all_reduce_moves_what_a_ring_moves(P):
    # a ring sends 2 * (P - 1) chunks of n / P per device: 2 * (P - 1) * n bytes in all, P * 2 * (P - 1) messages
    parts = [np.ones((3, 24), np.float32) * d for d in range(P)]
    link = Link()
    impl.all_reduce(parts, link)
    assert link.bytes_sent == 2 * (P - 1) * parts[0].nbytes
    assert link.messages == 2 * (P - 1) * P


@pytest.mark.exercise("all_reduce")
@pytest.mark.parametrize("shape", [(7,), (2, 3, 7)])
def test_all_reduce_splits_the_last_axis_of_any_shape(shape):
    # [..., n] with n = 7 not a multiple of P = 3 (chunks of 3, 2, 2), and a 1-D and a 3-D array
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    link = Link()
    out = impl.all_reduce(parts, link)
    for o in out:
        assert o.shape == shape
        np.testing.assert_allclose(o, np.sum(parts, axis=0), rtol=1e-5, atol=1e-6)
    assert link.messages == 2 * 2 * 3, "2 (P - 1) steps of P messages, whatever the shape"
