"""The LLaMA forward pass: embed -> L x (attention block, MLP block) -> norm -> LM head.

The other families (Qwen2, Qwen3, Gemma 3) run the same forward: what differs is a few switches of ModelConfig
(biases, Q/K norms, norms after each block, the MLP's activation, the embedding scale, a sliding window) and the
optional weights in LayerWeights that those switches use; every switch off is SmolLM2's LLaMA.

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
from .layers import apply_rope, gated_mlp, rms_norm, rope_tables


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
    # the families' extras, None for LLaMA (the ModelConfig switch that uses each is named on its right)
    q_bias: np.ndarray | None = None          # [N*H]  qkv_bias (Qwen2)
    k_bias: np.ndarray | None = None          # [K*H]
    v_bias: np.ndarray | None = None          # [K*H]
    q_norm: np.ndarray | None = None          # [H]    qk_norm (Qwen3, Gemma 3): one weight shared by every head
    k_norm: np.ndarray | None = None          # [H]
    post_attn_norm: np.ndarray | None = None  # [D]    post_norms (Gemma 3)
    post_mlp_norm: np.ndarray | None = None   # [D]


@dataclass(slots=True)
class Model:
    config: ModelConfig
    embed: np.ndarray          # [V, D]; also the LM head when tied: logits = h @ embed.T
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
    output: np.ndarray | None = None   # [V, D] the LM head of an untied model (config.tied_embeddings False)
    rope_local: tuple[np.ndarray, np.ndarray] | None = None  # cos, sin [P, H/2] of the local layers (rope_theta_local)
    gguf_tensors: dict | None = None   # a GGUF's tensors by name (gguf_file.TensorInfo): quant "gguf" multiplies
    #                                    their own blocks (quant.quantize_gguf); None for a model from a folder

    @property
    def head(self) -> np.ndarray:  # [V, D] float32: the LM head's weights, the embedding itself when tied
        return self.embed if self.output is None else self.output

    @property
    def lm_head(self):  # [D, V]: logits = h @ lm_head
        return self.head.T if self.lm_head_q is None else self.lm_head_q

    @classmethod
    def from_weights(cls, config: ModelConfig, embed: np.ndarray, layers: list[LayerWeights],
                     final_norm: np.ndarray, output: np.ndarray | None = None,
                     rope_factors: np.ndarray | None = None) -> "Model":
        """rope_factors [H/2]: Llama 3's long-context scaling (the GGUF's rope_freqs), dividing each frequency."""
        cos, sin = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta, rope_factors)
        local = None
        if config.rope_theta_local is not None:
            local = rope_tables(config.max_seq_len, config.head_dim, config.rope_theta_local)
        return cls(config, embed, layers, final_norm, cos, sin, output=output, rope_local=local)

    def num_parameters(self) -> int:
        size = lambda a: 0 if a is None else int(np.prod(a.shape))   # noqa: E731  (a float array or a quant.QuantizedLinear)
        n = self.embed.size + self.final_norm.size + size(self.output)
        for w in self.layers:
            n += sum(size(a) for a in (w.attn_norm, w.wq, w.wk, w.wv, w.wo, w.mlp_norm, w.w_gate, w.w_up, w.w_down,
                                       w.q_bias, w.k_bias, w.v_bias, w.q_norm, w.k_norm, w.post_attn_norm,
                                       w.post_mlp_norm))
        return n

    def rope_at(self, positions: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(cos, sin) [T, H/2] each of the global layers and of the local ones (the same unless rope_theta_local)."""
        glob = self.rope_cos[positions], self.rope_sin[positions]
        return glob, glob if self.rope_local is None else (self.rope_local[0][positions], self.rope_local[1][positions])


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


def linear(x: np.ndarray, w, bias: np.ndarray | None) -> np.ndarray:  # [T, D_in], [D_in, D_out], [D_out] -> [T, D_out]
    return x @ w if bias is None else x @ w + bias


def forward(model: Model, tokens: np.ndarray, positions: np.ndarray, attention: AttentionFn,
            logit_rows: np.ndarray | None = None) -> np.ndarray:
    """Run T tokens (of one or many sequences) through the model.

    tokens, positions: [T] ints. `logit_rows` picks the rows that need logits (e.g. the last token of each
    sequence): the LM head is the single largest matmul (V = 49152 columns), so prefill skips it for the rest.
    Returns logits [len(logit_rows) or T, V] float32. Quantised weights (lesson 7) multiply through `@` as well.
    """
    cfg, eps = model.config, model.config.norm_eps
    T, N, K, H = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rope_global, rope_local = model.rope_at(positions)                  # (cos, sin) [T, H/2] each
    x = model.embed[tokens]                                             # [T, D]
    if cfg.embed_scale != 1.0:   # Gemma: sqrt(D); the tied LM head reads the same rows unscaled
        x = x * np.float32(cfg.embed_scale)
    for i, w in enumerate(model.layers):
        cos, sin = rope_global if cfg.layer_window(i) is None else rope_local
        h = rms_norm(x, w.attn_norm, eps)                               # [T, D]
        q = linear(h, w.wq, w.q_bias).reshape(T, N, H)                  # [T, N, H]
        k = linear(h, w.wk, w.k_bias).reshape(T, K, H)                  # [T, K, H]
        v = linear(h, w.wv, w.v_bias).reshape(T, K, H)                  # [T, K, H]
        if cfg.qk_norm:   # each head's q and k rescaled to unit RMS: keeps the scores' scale in check
            q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        a = attention(i, q, k, v).reshape(T, N * H) @ w.wo              # [T, D]
        x = x + (rms_norm(a, w.post_attn_norm, eps) if cfg.post_norms else a)   # residual around attention
        f = gated_mlp(rms_norm(x, w.mlp_norm, eps), w.w_gate, w.w_up, w.w_down, cfg.activation)   # [T, D]
        x = x + (rms_norm(f, w.post_mlp_norm, eps) if cfg.post_norms else f)    # and around the MLP
    if logit_rows is not None:
        x = x[logit_rows]
    return rms_norm(x, model.final_norm, cfg.norm_eps) @ model.lm_head  # [R, V]
