"""Lesson 1: generate by re-running the whole prefix for every new token.

Simple and obviously correct, and the reference every faster path is checked against. Its cost is the lesson:
token n needs a forward over all n tokens, so the matmuls cost O(n) per token (O(n^2) in total) and
attention O(n^2) per token (O(n^3) in total).
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from .backend import forward as model_forward      # model.forward, or the kernels for a model loaded for them
from .kv_cache import rectangular_attention
from .layers import causal_attention
from .model import Model, check_token_ids
from .sampling import SamplingParams, sample
from .stopping import start_request


def forward(model: Model, ids: Sequence[int]) -> np.ndarray:
    """Logits for every position of `ids`: [len(ids), V] float32."""
    tokens = check_token_ids(model.config, ids)
    return model_forward(model, tokens, np.arange(len(tokens)), _attention(model))


def next_token_logits(model: Model, ids: np.ndarray) -> np.ndarray:  # [T] -> [V]
    last = np.array([len(ids) - 1])
    return model_forward(model, ids, np.arange(len(ids)), _attention(model), logit_rows=last)[0]


def _attention(model: Model):
    """Lesson 1's causal attention in every layer but a sliding-window one (Gemma 3's local layers), which
    attends through lesson 2's rectangular attention with its window (prefill: S = m)."""
    window = model.config.layer_window
    return lambda layer, q, k, v: (causal_attention(q, k, v) if window(layer) is None
                                   else rectangular_attention(q, k, v, window(layer)))


def generate_stream(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
                    params: SamplingParams | None = None, tokenizer=None) -> Iterator[int]:
    params = params or SamplingParams()
    tokens, stopper, rng = start_request(model.config, ids, max_new_tokens, params, tokenizer)  # prompt: [T]
    out: list[int] = []
    while True:
        seq = np.concatenate([tokens, np.asarray(out, dtype=np.int64)])
        tok = sample(next_token_logits(model, seq), params, rng, seen=seq)  # the whole prefix, every time
        out.append(tok)
        yield tok
        if stopper.should_stop(out):
            return


def generate(model: Model, ids: Sequence[int], max_new_tokens: int | None = None,
             params: SamplingParams | None = None, tokenizer=None) -> list[int]:
    """The new token ids only (prompt excluded), ending with the EOS id when it stopped on EOS."""
    return list(generate_stream(model, ids, max_new_tokens, params, tokenizer))
