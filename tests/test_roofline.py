"""The back-of-the-envelope formulas, checked against values computed by hand."""
from __future__ import annotations

import pytest

from tinyserve import roofline as rl
from tinyserve.config import ModelConfig

# SmolLM2-135M: L=30, N=9, K=3, H=576/9=64
SMOL = ModelConfig(dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536, vocab_size=49152)


def test_kv_bytes_per_token_smollm2():
    assert rl.kv_bytes_per_token(SMOL) == 2 * 30 * 3 * 64 * 4 == 46_080           # fp32: 45 KiB per token
    assert rl.kv_bytes_per_token(SMOL, bytes_per_value=2) == 23_040
    assert rl.kv_bytes_per_token(rl.with_kv_heads(SMOL, 9)) == 138_240             # as MHA: 3x
    assert rl.kv_bytes_per_token(rl.with_kv_heads(SMOL, 1)) == 15_360              # as MQA: 1/3


def test_kv_bytes_llama2_13b_mha_vs_gqa():
    # 2 * 40 layers * 40 heads * 128 dims * 2 bytes (fp16) = 819,200 B = 800 KiB per token
    assert rl.kv_bytes_per_token(rl.LLAMA2_13B, 2) == 819_200
    # 1:5 GQA (8 KV heads for 40 query heads): 5x smaller
    assert rl.kv_bytes_per_token(rl.with_kv_heads(rl.LLAMA2_13B, 8), 2) == 163_840
    # a 4096-token sequence: 3.125 GiB as MHA
    assert rl.kv_cache_bytes(rl.LLAMA2_13B, 4096, bytes_per_value=2) == 3_355_443_200
    assert rl.kv_bytes_per_token(rl.LLAMA2_70B, 2) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert rl.kv_bytes_per_token(rl.MISTRAL_7B, 2) == 131_072


def test_kv_cache_bytes_scales_with_tokens_and_sequences():
    assert rl.kv_cache_bytes(SMOL, 2048) == 94_371_840                             # 90 MiB at 2048 tokens
    assert rl.kv_cache_bytes(SMOL, 2048, n_seqs=4) == 4 * 94_371_840
    assert rl.kv_cache_bytes(SMOL, 0) == 0


def test_attention_decode_flops_and_bytes():
    S = 1000
    # per layer and query head: 2*S*H (q.k) + 2*S*H (p.v); 30 * 9 * 4 * 64 * 1000
    assert rl.attention_decode_flops(SMOL, S) == 69_120_000
    # reads each cached K and V value once: 2 * 30 * 1000 * 3 * 64 values * 4 bytes
    assert rl.attention_decode_bytes(SMOL, S) == 46_080_000 == S * rl.kv_bytes_per_token(SMOL)
    # np.repeat also writes and re-reads 2 * S * N * H values per layer: 2 * 2 * 30 * 1000 * 9 * 64 * 4 more
    assert rl.attention_decode_bytes(SMOL, S, repeat_kv=True) == 46_080_000 + 276_480_000


@pytest.mark.parametrize("cfg,g", [(SMOL, 3), (rl.LLAMA2_13B, 1), (rl.LLAMA2_70B, 8), (rl.MISTRAL_7B, 4)])
def test_arithmetic_intensity_is_the_group_size(cfg, g):
    assert rl.attention_arithmetic_intensity(cfg, bytes_per_value=2) == g          # FLOPs per byte, fp16 cache
    assert rl.attention_arithmetic_intensity(cfg, bytes_per_value=4) == g / 2      # fp32 halves it


def test_speculative_expected_tokens_by_hand():
    from tinyserve.roofline import speculative_best_k, speculative_tokens_per_step
    assert speculative_tokens_per_step(0.0, 4) == 1.0
    assert speculative_tokens_per_step(1.0, 4) == 5.0
    assert abs(speculative_tokens_per_step(0.5, 2) - 1.75) < 1e-12          # 1 + 0.5 + 0.25
    assert speculative_best_k(0.0, 0.1, 1.0) == 0                           # drafts never accepted: don't draft
    assert speculative_best_k(0.9, 0.0, 1.0, k_max=8) == 8                  # free drafts: draft as many as allowed
    # a = 0.8, draft 0.1 of a verify: k=1 -> 1.8/1.1 = 1.64, k=4 -> 3.36/1.4 = 2.40, k=6 -> 3.95/1.6 = 2.47,
    # k=7 -> 4.16/1.7 = 2.45: the best is 6
    assert speculative_best_k(0.8, 0.1, 1.0) == 6


# --- lesson 9: the calculator ------------------------------------------------------------------------------------

def test_measure_bandwidth_is_a_plausible_rate():
    read = rl.measure_bandwidth(nbytes=64 * 2**20, repeat=3)
    copy = rl.measure_bandwidth(nbytes=64 * 2**20, repeat=3, kind="copy")
    for bw in (read, copy):                       # bytes/s: any machine this runs on lies between 100 MB/s and 10 TB/s
        assert isinstance(bw, float) and 1e8 < bw < 1e13
    with pytest.raises(ValueError, match="kind"):
        rl.measure_bandwidth(kind="write")
    with pytest.raises(ValueError, match="nbytes"):
        rl.measure_bandwidth(nbytes=0)


def test_this_cpu_uses_given_or_measured_figures():
    chip = rl.this_cpu(bandwidth=2e10, flops=1e11)
    assert (chip.hbm_bandwidth, chip.flops) == (2e10, 1e11) and chip.hbm_bytes > 1e9
    measured = rl.this_cpu()
    assert 1e8 < measured.hbm_bandwidth < 1e13 and 1e8 < measured.flops < 1e15


def test_model_shape_of_smollm2_counts_the_real_weights(tiny):
    shape = rl.ModelShape.from_config(SMOL)
    norms = 30 * 2 * 576 + 576
    assert shape.params() == 134_515_008 - norms == shape.active_params()
    assert shape.kv_bytes_per_token(4) == rl.kv_bytes_per_token(SMOL)
    tiny_shape = rl.ModelShape.from_config(tiny.config)
    c = tiny.config
    assert tiny_shape.params() == tiny.num_parameters() - (2 * c.n_layers + 1) * c.dim


def test_calculator_refuses_impossible_inputs():
    with pytest.raises(ValueError, match="n_kv_heads"):
        rl.ModelShape(2, 64, 128, 4, 3, 16, 100)
    with pytest.raises(ValueError, match="experts_per_token"):
        rl.ModelShape(2, 64, 128, 4, 2, 16, 100, n_experts=2, experts_per_token=3)
    with pytest.raises(ValueError, match="kv_shards"):
        rl.decode_step_time(rl.TPU_V5E, 4, 1, 1e9, 1e6, 2, kv_shards=8)
    with pytest.raises(ValueError, match="batch"):
        rl.decode_step_time(rl.TPU_V5E, 4, 0, 1e9, 1e6, 2)
    with pytest.raises(ValueError, match="positive"):
        rl.Chip("broken", 16e9, 0, 1e14)


def test_max_batch_and_latency_bound_agree_with_step_time():
    # the latency bound is tight: B fits under the target, B + 1 does not
    for ctx in (512, 2048, 8192, 32768):
        kv = ctx * 2 * 80 * 8 * 128
        B = rl.largest_batch_within(rl.TPU_V5E, 16, 12e-3, 70e9, kv, 1)
        assert rl.decode_step_time(rl.TPU_V5E, 16, B, 70e9, kv, 1) <= 12e-3 < \
            rl.decode_step_time(rl.TPU_V5E, 16, B + 1, 70e9, kv, 1)
    # the capacity bound is tight: B sequences' KV fits beside the weights, B + 1 does not
    B = rl.max_batch(rl.H100, 8, 4096, 70e9, 327_680, 2)
    free = 80e9 - 70e9 * 2 / 8
    assert B * 4096 * 327_680 / 8 <= free < (B + 1) * 4096 * 327_680 / 8


def test_prefill_time_is_compute_bound_for_long_prompts():
    assert rl.prefill_time(rl.TPU_V5E, 16, 8192, 70e9, 1) == pytest.approx(2 * 70e9 * 8192 / (16 * 1.97e14))
    assert rl.prefill_time(rl.TPU_V5E, 16, 1, 70e9, 1) == pytest.approx(70e9 / (16 * 8.1e11))   # one token: a read


def test_tensor_parallel_comm_time_by_hand():
    shape = rl.ModelShape(80, 8192, 28672, 64, 8, 128, 32000)          # LLaMA-2-70B
    # 8 H100s, bf16, batch 1: per device 2 * 80 layers * 2 * 7/8 * 8192 * 2 B + 7/8 * 32000 * 2 B
    per_device = 2 * 80 * 2 * 7 / 8 * 8192 * 2 + 7 / 8 * 32000 * 2
    assert rl.tensor_parallel_comm_time(rl.H100, shape, 8, 1) == pytest.approx(per_device / 4.5e11)
    # each of the 160 all-reduces takes 2 * 7 ring steps, the logits' all-gather 7: 2247 hops of 1 us
    assert rl.tensor_parallel_comm_time(rl.H100, shape, 8, 16, hop_latency=1e-6) == \
        pytest.approx(16 * per_device / 4.5e11 + 2247e-6)
    assert rl.tensor_parallel_comm_time(rl.H100, shape, 1, 64) == 0.0
    with pytest.raises(ValueError, match="link_bandwidth"):
        rl.tensor_parallel_comm_time(rl.Chip("no link", 1e9, 1e10, 1e11), shape, 2, 1)
