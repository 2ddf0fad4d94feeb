"""The LLaMA forward pass: embed -> L x (attention block, MLP block) -> norm -> tied LM head.

Attention is the one piece that differs between lessons (recompute everything, a KV cache, paged blocks,
a prefix trie), so `forward` takes it as a function: everything else (the matmuls, which dominate the
cost) is written once, for a flat batch of T tokens that may come from many sequences.

This is the readable reference, plain NumPy, and it knows nothing of the fast path: which forward runs for a
model (this one or lesson 7's Numba kernels) is decided in backend.py, which the strategies call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .config import ModelConfig
from .layers import apply_rope, rms_norm, rope_tables, swiglu_mlp


FLOAT32 = "none"     # Model.quant of the float32 weights (quant.NONE's name: the modes are quant.py's registry)


@dataclass(slots=True)
class LayerWeights:
    attn_norm: np.ndarray  # [D]
    wq: np.ndarray         # [D, N*H]
    wk: np.ndarray         # [D, K*H]
    wv: np.ndarray         # [D, K*H]
    wo: np.ndarray         # [N*H, D]
    mlp_norm: np.ndarray   # [D]
    w_gate: np.ndarray     # [D, F]
    w_up: np.ndarray       # [D, F]
    w_down: np.ndarray     # [F, D]


@dataclass(slots=True)
class Model:
    config: ModelConfig
    embed: np.ndarray          # [V, D]; also the LM head (tied): logits = h @ embed.T
    layers: list[LayerWeights]
    final_norm: np.ndarray     # [D]
    rope_cos: np.ndarray       # [max_seq_len, H/2]
    rope_sin: np.ndarray       # [max_seq_len, H/2]
    # Lesson 7. quant: the name of a quant.QuantMode (FLOAT32: none); quantised, the matmul weights of `layers` are
    # quant.QuantizedLinear or quant.Q4Linear and lm_head_q is the int8 LM head. backend: "numpy" (this file: the
    # readable reference) | "numba" (kernels/: the fast path; `fast` caches its packed weights). backend.forward
    # reads both and runs the one chosen.
    lm_head_q: object | None = None
    quant: str = FLOAT32
    backend: str = "numpy"
    fast: object | None = None

    @property
    def lm_head(self):  # [D, V]: logits = h @ lm_head
        return self.embed.T if self.lm_head_q is None else self.lm_head_q

    @classmethod
    def from_weights(cls, config: ModelConfig, embed: np.ndarray, layers: list[LayerWeights],
                     final_norm: np.ndarray) -> "Model":
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta)
        return cls(config, embed, layers, final_norm, cos, sin)

    def num_parameters(self) -> int:
        size = lambda a: int(np.prod(a.shape))   # noqa: E731  (a float array or a quant.QuantizedLinear)
        n = self.embed.size + self.final_norm.size
        for w in self.layers:
            n += sum(size(a) for a in (w.attn_norm, w.wq, w.wk, w.wv, w.wo, w.mlp_norm, w.w_gate, w.w_up, w.w_down))
        return n


# attention(layer index, q [T, N, H], k [T, K, H], v [T, K, H]) -> [T, N, H]; q and k already carry RoPE.
AttentionFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


def check_token_ids(config: ModelConfig, ids: Sequence[int], what: str = "prompt") -> np.ndarray:
    """Validate a list of token ids and return it as an int64 array [T] (clear errors, never deep tracebacks)."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what}: token ids must be a flat list of integers ({e})") from None
    if arr.ndim != 1:
        raise ValueError(f"{what}: token ids must be a flat list of integers, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{what} is empty: give at least one token")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: token ids must be integers, got dtype {arr.dtype}")
    bad = (arr < 0) | (arr >= config.vocab_size)
    if bad.any():
        raise ValueError(f"{what}: token id {int(arr[bad][0])} is out of range [0, {config.vocab_size})")
    if arr.size > config.max_seq_len:
        raise ValueError(f"{what} has {arr.size} tokens, longer than the context window ({config.max_seq_len})")
    return arr.astype(np.int64)


def forward(model: Model, tokens: np.ndarray, positions: np.ndarray, attention: AttentionFn,
            logit_rows: np.ndarray | None = None) -> np.ndarray:
    """Run T tokens (of one or many sequences) through the model.

    tokens, positions: [T] ints. `logit_rows` picks the rows that need logits (e.g. the last token of each
    sequence): the LM head is the single largest matmul (V = 49152 columns), so prefill skips it for the rest.
    Returns logits [len(logit_rows) or T, V] float32. Quantised weights (lesson 7) multiply through `@` as well.
    """
    cfg = model.config
    T, N, K, H = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]   # [T, H/2]
    x = model.embed[tokens]                                             # [T, D]
    for i, w in enumerate(model.layers):
        h = rms_norm(x, w.attn_norm, cfg.norm_eps)                        # [T, D]
        q = apply_rope((h @ w.wq).reshape(T, N, H), cos, sin)           # [T, N, H]
        k = apply_rope((h @ w.wk).reshape(T, K, H), cos, sin)           # [T, K, H]
        v = (h @ w.wv).reshape(T, K, H)                                 # [T, K, H]
        x = x + attention(i, q, k, v).reshape(T, N * H) @ w.wo         # residual around attention
        x = x + swiglu_mlp(rms_norm(x, w.mlp_norm, cfg.norm_eps), w.w_gate, w.w_up, w.w_down)  # and around MLP
    if logit_rows is not None:
        x = x[logit_rows]
    return rms_norm(x, model.final_norm, cfg.norm_eps) @ model.lm_head  # [R, V]
