"""Back-of-the-envelope formulas: predict a number before measuring it.

Started in lesson 3 with the KV cache and attention; later lessons add step-time bounds. Every function takes
a ModelConfig (shapes in the legend of config.py) and counts exactly what it says, so tests can check it against
hand-computed values. FLOPs count a multiply-add as 2.
"""
from __future__ import annotations

from dataclasses import replace

from .config import ModelConfig

# Published shapes of well-known models, for comparison with SmolLM2 (only the fields the formulas use matter).
LLAMA2_7B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
                        vocab_size=32000, max_seq_len=4096)                     # MHA
LLAMA2_13B = ModelConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, intermediate_size=13824,
                         vocab_size=32000, max_seq_len=4096)                    # MHA
LLAMA2_70B = ModelConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, intermediate_size=28672,
                         vocab_size=32000, max_seq_len=4096)                    # GQA, g = 8
MISTRAL_7B = ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
                         vocab_size=32000, max_seq_len=32768)                   # GQA, g = 4


def with_kv_heads(config: ModelConfig, n_kv_heads: int) -> ModelConfig:
    """The same model with K key/value heads: K = N is MHA, K = 1 is MQA, anything between is GQA."""
    return replace(config, n_kv_heads=n_kv_heads)


def kv_bytes_per_token(config: ModelConfig, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache one token occupies: 2 (K and V) * L * K * H * bytes per value."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * bytes_per_value


def kv_cache_bytes(config: ModelConfig, n_tokens: int, n_seqs: int = 1, bytes_per_value: int = 4) -> int:
    """Bytes of KV cache for n_seqs sequences of n_tokens tokens each."""
    return n_seqs * n_tokens * kv_bytes_per_token(config, bytes_per_value)


def attention_decode_flops(config: ModelConfig, context: int) -> int:
    """FLOPs of attention in one decode step (one new token over `context` cached positions), all layers.

    Per layer and query head: q.k over S keys (2*S*H) and the weighted sum of S values (2*S*H). The softmax
    (a few FLOPs per score) and the Q/K/V/O projections (counted with the weights) are left out.
    """
    return 4 * config.n_layers * config.n_heads * config.head_dim * context


def attention_decode_bytes(config: ModelConfig, context: int, bytes_per_value: int = 4,
                           repeat_kv: bool = False) -> int:
    """Bytes attention moves in one decode step: every cached K and V value is read once.

    With repeat_kv (lesson 2's np.repeat), each layer also writes the g-times repeated K and V ([S, N, H] each)
    and reads them back for the matmuls: 2 * (2 * S * N * H) values more per layer. Queries and outputs (N*H
    values) and scores (N*S) are ignored: about g / (2*H) of the cache traffic (2 % for SmolLM2).
    """
    read_cache = 2 * config.n_layers * context * config.n_kv_heads * config.head_dim
    repeated = 2 * 2 * config.n_layers * context * config.n_heads * config.head_dim if repeat_kv else 0
    return (read_cache + repeated) * bytes_per_value


def attention_arithmetic_intensity(config: ModelConfig, bytes_per_value: int = 2) -> float:
    """FLOPs per byte of decode attention (grouped, no repeat): 4*N*H*S / (2*K*H*S*b) = 2*g / b.

    Independent of the context length. With a 16-bit cache (b = 2) it is exactly g, the query heads per K/V head:
    each K/V value fetched from memory serves g query heads. MHA (g = 1) sits deep in the memory-bound region.
    """
    return attention_decode_flops(config, 1) / attention_decode_bytes(config, 1, bytes_per_value)
