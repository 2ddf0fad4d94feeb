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
            "params: write out the shape of every weight matrix of one layer (attention has four, and only two of "
            "them are as wide as the query heads; how many matrices does a SwiGLU MLP have?), then the embedding")

    def active_params(self) -> int:
        """The weights one token multiplies with: experts_per_token of the n_experts MLPs per layer."""
        raise NotImplementedError("active_params: which of the weights counted in params does one token skip?")

    def kv_bytes_per_token(self, bytes_per_value: float = 2) -> float:
        """Bytes of KV cache per token: K and V, every layer, every KV head."""
        raise NotImplementedError(
            "kv_bytes_per_token: what does one token store, in every layer, for every KV head? (lesson 3)")


def critical_batch(chip: Chip, bytes_per_param: float, n_experts: int = 1, experts_per_token: int = 1) -> float:
    """The decode batch at which the weight matmuls turn from memory-bound to compute-bound (MoE: per expert)."""
    raise NotImplementedError(
        "critical_batch: write the time to read P weights and the time to multiply them with B rows; at which B "
        "are they equal (does P matter)? MoE: how many of the batch's tokens reach one expert?")


def decode_step_time(chip: Chip, n_chips: int, batch: int, params: float, kv_bytes_per_sequence: float,
                     bytes_per_param: float, kv_shards: int | None = None) -> float:
    """Seconds per decode step, per chip: max(weight read, matmul FLOPs) + the KV read.
    Weights and FLOPs are split over n_chips; the batch's KV cache over kv_shards chips (None: all n_chips)."""
    raise NotImplementedError(
        "decode_step_time: three times per chip: its share of the weights read, its share of the FLOPs, its share "
        "of the batch's KV read. Which two overlap (the chip does them at once), and which one does not?")


def max_batch(chip: Chip, n_chips: int, context: int, params: float, kv_bytes_per_token: float,
              bytes_per_param: float, reserved_bytes: float = 0, kv_shards: int | None = None) -> int:
    """How many sequences of `context` tokens fit beside the weights (reserved_bytes is per chip). 0 if none."""
    raise NotImplementedError(
        "max_batch: how many bytes are left on one chip once it holds its share of the weights, and how many "
        "bytes does one sequence put on each chip? A partial sequence does not fit")


def largest_batch_within(chip: Chip, n_chips: int, step_time: float, params: float, kv_bytes_per_sequence: float,
                         bytes_per_param: float, kv_shards: int | None = None) -> int:
    """The largest batch whose decode_step_time stays within `step_time` seconds (0 if none)."""
    raise NotImplementedError(
        "largest_batch_within: the step time is max(w, c*B) + k*B. When is max(a, b) + x <= T? Both branches "
        "must hold; solve each for B")


def disaggregated_rates(chip: Chip, prefill_chips: int, decode_chips: int, prompt_len: int, output_len: int,
                        decode_batch: int, params: float, kv_bytes_per_token: float, bytes_per_param: float,
                        link_bandwidth: float) -> DisaggregatedRates:
    """Requests/s of a prefill group (one prompt at a time: max(2*P*T FLOPs, one weight read) per prompt), a decode
    group (decode_batch sequences at a mean context of prompt_len + output_len / 2, finishing decode_batch requests
    every output_len steps) and the link that hands each request's prompt KV cache over."""
    raise NotImplementedError(
        "disaggregated_rates: the time of one prefill (a prompt is a batch of prompt_len rows: which regime?), the "
        "time for the decode group to finish decode_batch requests, and the bytes each request sends over the link")


def all_reduce(parts: list[np.ndarray], link: Link) -> list[np.ndarray]:
    """Ring all-reduce: P devices hold partial arrays [..., n]; afterwards every device holds the same sum.
    Every transfer goes through link.send(chunk); do not modify `parts`."""
    raise NotImplementedError(
        "all_reduce: cut each device's array into P chunks (np.array_split). In a ring, device d only ever sends to "
        "d + 1: which chunk should it pass on at each of P - 1 steps so that every chunk collects all P "
        "contributions somewhere, and how do the finished chunks then reach everyone?")
