"""Lesson 8: predict latency under load before measuring it — the roofline for one step, Little's law for many.

A decode step reads every weight once for the whole batch and each sequence's K/V once, so at small batch it is
memory-bound: t_step(B) ~ (weight bytes + B * context * KV bytes per token) / bandwidth. A prefill token costs
~2 * params FLOPs instead (compute-bound). Under a steady arrival rate lambda, Little's law L = lambda * W ties the
number of requests in the system (the batch B) to the time each spends there (W ~ TTFT + n_out * t_step(B)), and
t_step itself grows with B: the batch settles where both agree — or never does, when lambda * n_out * t_step(B)
outgrows B (the server is past its capacity and the queue grows without bound).

The interleaved design mixes prefill chunks into decode steps: `interleave_budget` is its per-step rule, and
`step_with_prefill` what it costs the running decodes (their inter-token latency).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .config import ModelConfig
from .roofline import kv_bytes_per_token


def num_parameters(config: ModelConfig) -> int:
    """Parameters of a LLaMA-style model with a tied embedding (the LM head reuses it): all of them are read by
    every decode step."""
    D, F, L = config.dim, config.intermediate_size, config.n_layers
    H, N, K, V = config.head_dim, config.n_heads, config.n_kv_heads, config.vocab_size
    per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F + 2 * D   # q, k+v, o, gate+up+down, 2 norms
    return V * D + L * per_layer + D


def decode_step_seconds(config: ModelConfig, batch: int, context: int, bandwidth: float,
                        bytes_per_weight: float = 4, bytes_per_kv: int = 4) -> float:
    """Memory-bound lower bound of one decode step: the weights once + every sequence's K/V once, / bandwidth."""
    moved = num_parameters(config) * bytes_per_weight + batch * context * kv_bytes_per_token(config, bytes_per_kv)
    return moved / bandwidth


def prefill_seconds_per_token(config: ModelConfig, flops_per_s: float) -> float:
    """Compute-bound cost of one prompt token: 2 FLOPs per parameter (attention over a short prompt is small)."""
    return 2 * num_parameters(config) / flops_per_s


def interleave_budget(num_decoding: int, prefill_remaining: Sequence[int], token_budget: int) -> tuple[int, list[int]]:
    """One interleaved step's token budget: who runs how many tokens.

    Decodes go first, one token each (a running request's next token should never wait behind someone's prompt;
    if the budget cannot cover them all, only the first `token_budget` run). What is left goes to the waiting
    prompts in arrival order, each taking up to what it still has to prefill: a long prompt is cut into chunks
    over several steps. Returns (decodes that run, [tokens for each prompt]) — the chunks sum to at most what
    is left of the budget, and a prompt gets tokens only if every prompt before it got all of its remainder.
    """
    decodes = min(num_decoding, token_budget)
    left = token_budget - decodes
    chunks = []
    for remaining in prefill_remaining:
        take = min(remaining, left)
        chunks.append(take)
        left -= take
    return decodes, chunks


def step_with_prefill(decode_step: float, prefill_tokens: int, prefill_per_token: float) -> float:
    """A step that carries a prefill chunk lasts about as long as the decode step plus the chunk's compute: every
    decode in that step waits this long for its next token (the interleaved design's ITL spike)."""
    return decode_step + prefill_tokens * prefill_per_token


@dataclass(frozen=True, slots=True)
class LoadPrediction:
    rate: float                # requests / s
    batch: float               # requests in the system (Little's L)
    step: float                # s per decode step at that batch
    ttft: float                # s: one step of wait (arrival is uniform within a step) + the prompt's prefill
    itl: float                 # s: one decode step
    stable: bool               # False: the rate exceeds what the server can drain; the queue grows forever

    @property
    def latency(self) -> float:  # W
        return self.batch / self.rate if self.rate else 0.0


def predict_load(rate: float, prompt_tokens: float, output_tokens: float, step_seconds: Callable[[float], float],
                 prefill_per_token: float, max_batch: float = 64, iters: int = 200) -> LoadPrediction:
    """Fixed point of Little's law: B = rate * W with W = TTFT + (output_tokens - 1) * t_step(B).

    step_seconds(B) is the decode step time at batch B (e.g. decode_step_seconds, or a measured fit). Stable when
    the iteration settles below max_batch; else the server is saturated (reported with stable=False, batch =
    max_batch: the queue, not the batch, absorbs the excess)."""
    b = 1.0
    for _ in range(iters):
        step = step_seconds(b)
        ttft = step / 2 + step + prompt_tokens * prefill_per_token
        w = ttft + (output_tokens - 1) * step
        nb = max(rate * w, 1e-9)
        if nb > max_batch:
            step = step_seconds(max_batch)
            return LoadPrediction(rate, max_batch, step, float("inf"), step, False)
        if abs(nb - b) < 1e-6:
            break
        b = 0.5 * (b + nb)
    step = step_seconds(b)
    return LoadPrediction(rate, b, step, step / 2 + step + prompt_tokens * prefill_per_token, step, True)
