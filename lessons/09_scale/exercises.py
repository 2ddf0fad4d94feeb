"""Lesson 9 exercises: the calculator for inference at scale, and the ring all-reduce. Then run `make check-9`.

The reference answers are in tinyserve/roofline.py and tinyserve/tensor_parallel.py: try first, peek later. Units:
bytes, seconds, FLOP/s; GB = 1e9 bytes. A Chip has .hbm_bytes, .hbm_bandwidth (B/s) and .flops (FLOP/s).
"""
from __future__ import annotations

import numpy as np

from tinyserve.roofline import Chip, DisaggregatedRates  # noqa: F401  (the types you take and return)
from tinyserve.tensor_parallel import Link  # noqa: F401  (link.send(array) counts the bytes and returns a copy)


class ModelShape:
    """The shapes that set a transformer's size. head_dim need not be d_model // n_heads.
    MoE: each layer has n_experts MLPs of d_ff each; a token uses experts_per_token of them."""

    def __init__(self, n_layers: int, d_model: int, d_ff: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 vocab: int, tied_embeddings: bool = True, n_experts: int = 1, experts_per_token: int = 1):
        # given: the fields. Implement the three methods below.
        self.n_layers, self.d_model, self.d_ff = n_layers, d_model, d_ff
        self.n_heads, self.n_kv_heads, self.head_dim, self.vocab = n_heads, n_kv_heads, head_dim, vocab
        self.tied_embeddings, self.n_experts, self.experts_per_token = tied_embeddings, n_experts, experts_per_token

    def params(self) -> int:
        """All weights: attention + every expert's MLP + the embedding (and the LM head if not tied). No norms."""
        raise NotImplementedError(
            "params: per layer, W_q and W_o are [D, N*H] and [N*H, D], W_k and W_v [D, K*H]; the SwiGLU MLP has "
            "three [D, F] matrices (gate, up, down), n_experts of them; the embedding is [V, D]")

    def active_params(self) -> int:
        """The weights one token multiplies with: experts_per_token of the n_experts MLPs per layer."""
        raise NotImplementedError("active_params: like params, with experts_per_token MLPs per layer")

    def kv_bytes_per_token(self, bytes_per_value: float = 2) -> float:
        """Bytes of KV cache per token: K and V, every layer, every KV head."""
        raise NotImplementedError("kv_bytes_per_token: 2 * L * K * H * bytes per value")


def critical_batch(chip: Chip, bytes_per_param: float, n_experts: int = 1, experts_per_token: int = 1) -> float:
    """The decode batch at which the weight matmuls turn from memory-bound to compute-bound (MoE: per expert)."""
    raise NotImplementedError(
        "critical_batch: reading P weights takes P * bytes_per_param / bandwidth, multiplying them with B rows "
        "2 * P * B / flops; solve for the B where they are equal. MoE: each expert sees only "
        "B * experts_per_token / n_experts of the tokens")


def decode_step_time(chip: Chip, n_chips: int, batch: int, params: float, kv_bytes_per_sequence: float,
                     bytes_per_param: float, kv_shards: int | None = None) -> float:
    """Seconds per decode step, per chip: max(weight read, matmul FLOPs) + the KV read.
    Weights and FLOPs are split over n_chips; the batch's KV cache over kv_shards chips (None: all n_chips)."""
    raise NotImplementedError(
        "decode_step_time: weights params * bytes_per_param / (n_chips * bandwidth); FLOPs 2 * params * batch / "
        "(n_chips * flops); KV batch * kv_bytes_per_sequence / (kv_shards * bandwidth)")


def max_batch(chip: Chip, n_chips: int, context: int, params: float, kv_bytes_per_token: float,
              bytes_per_param: float, reserved_bytes: float = 0, kv_shards: int | None = None) -> int:
    """How many sequences of `context` tokens fit beside the weights (reserved_bytes is per chip). 0 if none."""
    raise NotImplementedError(
        "max_batch: per chip, memory minus reserved minus its share of the weights is left for KV; each sequence "
        "puts context * kv_bytes_per_token / kv_shards bytes on every chip; round down")


def largest_batch_within(chip: Chip, n_chips: int, step_time: float, params: float, kv_bytes_per_sequence: float,
                         bytes_per_param: float, kv_shards: int | None = None) -> int:
    """The largest batch whose decode_step_time stays within `step_time` seconds (0 if none)."""
    raise NotImplementedError(
        "largest_batch_within: max(w, c*B) + k*B <= T needs both w + k*B <= T and (c + k)*B <= T")


def disaggregated_rates(chip: Chip, prefill_chips: int, decode_chips: int, prompt_len: int, output_len: int,
                        decode_batch: int, params: float, kv_bytes_per_token: float, bytes_per_param: float,
                        link_bandwidth: float) -> DisaggregatedRates:
    """Requests/s of a prefill group (one prompt at a time: max(2*P*T FLOPs, one weight read) per prompt), a decode
    group (decode_batch sequences at a mean context of prompt_len + output_len / 2, finishing decode_batch requests
    every output_len steps) and the link that hands each request's prompt KV cache over."""
    raise NotImplementedError(
        "disaggregated_rates: DisaggregatedRates(prefill=1 / prefill time, decode=decode_batch / (step time * "
        "output_len), handover=link_bandwidth / (prompt_len * kv_bytes_per_token))")


def all_reduce(parts: list[np.ndarray], link: Link) -> list[np.ndarray]:
    """Ring all-reduce: P devices hold partial arrays [..., n]; afterwards every device holds the same sum.
    Every transfer goes through link.send(chunk); do not modify `parts`."""
    raise NotImplementedError(
        "all_reduce: split each array into P chunks on the last axis (np.array_split). Reduce-scatter: in step s "
        "of P - 1, device d sends chunk (d - s) % P to device (d + 1) % P, which adds it to its own copy. Then "
        "device d holds the finished chunk (d + 1) % P; P - 1 more steps pass the finished chunks round the ring")
