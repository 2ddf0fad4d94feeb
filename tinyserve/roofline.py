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


# --- speculative decoding (lesson 6; lesson 9's calculator reuses these) -------------------------------------------

def speculative_tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens one verify step yields with k drafted tokens, each accepted with probability `acceptance`.

    Token i (1-based) of the draft survives only if all i before it did: P = a^i. The step always yields one token
    from the target (the correction, or the bonus when all k agree), so E = 1 + a + a^2 + ... + a^k
    = (1 - a^(k+1)) / (1 - a), which is k + 1 at a = 1 and 1 at a = 0.
    """
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be a probability in [0, 1], got {acceptance!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"k (tokens drafted per step) must be an integer >= 0, got {k!r}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def speculative_best_k(acceptance: float, draft_cost: float, verify_cost: float, k_max: int = 16) -> int:
    """The draft length k in 0..k_max with the most expected tokens per unit of time.

    One step costs k * draft_cost + verify_cost (the target scores k + 1 rows in one forward, which at small batch
    costs about as much as one decode: the weights are read once) and yields speculative_tokens_per_step(a, k).
    k = 0 is plain decoding. Costs in any one unit (seconds, or relative to a decode step).
    """
    if draft_cost < 0 or verify_cost <= 0:
        raise ValueError(f"need draft_cost >= 0 and verify_cost > 0, got {draft_cost!r}, {verify_cost!r}")
    rate = [speculative_tokens_per_step(acceptance, k) / (k * draft_cost + verify_cost) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=rate.__getitem__)
