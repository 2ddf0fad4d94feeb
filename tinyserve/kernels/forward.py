"""The fast forward: model.forward's steps with int8 Numba kernels, for a model loaded with quant="int8"|"w8a8"
and backend="numba". model.forward calls it; it returns the same logits as the NumPy reference of the same
quantised weights (tinyserve.quant) up to float order: W8A8 matmuls are bit-identical, RMSNorm and SwiGLU sum in
a different order (~1e-6 relative), W8A32 matmuls too (tests/test_fast_forward.py).

What it does differently, and why each pays (lesson 7 measures them):
- Q|K|V are one matrix [D, (N + 2K) H] and gate|up one [D, 2F]: a decode step launches 4 matmuls per layer
  instead of 7, and the small K and V projections (192 columns) no longer pay a kernel launch each.
- RMSNorm is fused with the activation quantisation (W8A8), SwiGLU too: one pass over the row instead of three.
- The O and down projections add into the residual stream in place (`accumulate=True`): no temporary.
- Everything runs on Numba's thread pool; NumPy's BLAS (used by the attention reference) is held at one thread
  for the whole forward, so two pools never fight over the 2 cores (perf-notes: that trap costs ~10x).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import single_thread_blas
from .matmul import (matmul_w8a8, matmul_w8a32, pack_vnni, pack_w8a32, quantize_rows, rms_norm_quant,
                     rms_norm_rows, split_rope, swiglu_quant, swiglu_rows)


@dataclass(slots=True)
class PackedLinear:
    """One quantised matrix [D_in, O] laid out for its kernel."""
    w: np.ndarray          # W8A8: pack_vnni -> [O/16, D_in/4*64]; W8A32: pack_w8a32 -> [O/16, D_in, 16] (int8)
    wsum: np.ndarray       # [O] int32: column sums of the int8 weights (W8A8 undoes the +128 activation offset)
    scale: np.ndarray      # [O] float32


@dataclass(slots=True)
class PackedLayer:
    attn_norm: np.ndarray  # [D]
    qkv: PackedLinear      # [D, (N + 2K) H]
    o: PackedLinear        # [N H, D]
    mlp_norm: np.ndarray   # [D]
    gate_up: PackedLinear  # [D, 2F]
    down: PackedLinear     # [F, D]


@dataclass(slots=True)
class FastWeights:
    mode: str              # "int8" | "w8a8"
    layers: list[PackedLayer]
    lm_head: PackedLinear  # [D, V]


def _pack(mode: str, *qs) -> PackedLinear:
    """QuantizedLinears side by side (same input) -> one packed matrix: a fused projection."""
    wq = np.concatenate([q.wq for q in qs], axis=1)                                  # [D_in, sum O]
    scale = np.concatenate([q.scale for q in qs])
    wsum = wq.sum(axis=0, dtype=np.int32)
    return PackedLinear(pack_vnni(wq) if mode == "w8a8" else pack_w8a32(wq), wsum, scale)


def prepare(model) -> FastWeights:
    """Pack a quantised model's weights for the kernels (once per model; ~1 s for SmolLM2)."""
    mode = model.quant
    layers = [PackedLayer(w.attn_norm, _pack(mode, w.wq, w.wk, w.wv), _pack(mode, w.wo), w.mlp_norm,
                          _pack(mode, w.w_gate, w.w_up), _pack(mode, w.w_down)) for w in model.layers]
    return FastWeights(mode, layers, _pack(mode, model.lm_head_q))


class _Linear:
    """y = x @ W for one mode: `norm` (RMSNorm, then W), `plain`, `swiglu` (silu(gate) * up, then W)."""

    def __init__(self, mode: str, eps: float):
        self.w8a8 = mode == "w8a8"
        self.eps = np.float32(eps)

    def _run(self, xu_or_x, sx, p: PackedLinear, out, accumulate):
        if self.w8a8:
            return matmul_w8a8(xu_or_x, sx, p.w, p.wsum, p.scale, out, accumulate)
        return matmul_w8a32(xu_or_x, p.w, p.scale, out, accumulate)

    def _quantized(self, x):                        # [T, D] float32 -> what the matmul takes
        if not self.w8a8:
            return x, None
        xu, sx = np.empty(x.shape, np.uint8), np.empty(x.shape[0], np.float32)
        quantize_rows(x, xu, sx)
        return xu, sx

    def norm(self, x, weight, p, out=None, accumulate=False):
        # [T]: what np.mean(np.square(x), -1) in layers.rms_norm computes, bit for bit (see kernels/matmul.py),
        # without np.mean's Python-level overhead (~5 us a call, 61 calls a step)
        ms = np.add.reduce(x * x, axis=-1) / np.float32(x.shape[1])
        if self.w8a8:
            xu, sx = np.empty(x.shape, np.uint8), np.empty(x.shape[0], np.float32)
            rms_norm_quant(x, ms, weight, self.eps, xu, sx)
            return self._run(xu, sx, p, out, accumulate)
        h = np.empty_like(x)
        rms_norm_rows(x, ms, weight, self.eps, h)
        return self._run(h, None, p, out, accumulate)

    def plain(self, x, p, out=None, accumulate=False):
        return self._run(*self._quantized(x), p, out, accumulate)

    def swiglu(self, gu, p, out=None, accumulate=False):
        T, F = gu.shape[0], gu.shape[1] // 2
        e = np.exp(-gu[:, :F])                      # [T, F]: NumPy's exp, as layers.silu (see kernels/matmul.py)
        if self.w8a8:
            xu, sx = np.empty((T, F), np.uint8), np.empty(T, np.float32)
            swiglu_quant(gu, e, xu, sx)
            return self._run(xu, sx, p, out, accumulate)
        a = np.empty((T, F), np.float32)
        swiglu_rows(gu, e, a)
        return self._run(a, None, p, out, accumulate)


def fast_forward(model, tokens: np.ndarray, positions: np.ndarray, attention, logit_rows=None) -> np.ndarray:
    """model.forward for quantised weights on the Numba backend (same arguments, same result up to float order)."""
    if model.fast is None:
        model.fast = prepare(model)
    fw: FastWeights = model.fast
    cfg = model.config
    T, N, K, H = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    lin = _Linear(fw.mode, cfg.norm_eps)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]                # [T, H/2]
    x = model.embed[tokens]                                                         # [T, D] (a copy: ours to update)
    with single_thread_blas():
        for i, w in enumerate(fw.layers):
            qkv = lin.norm(x, w.attn_norm, w.qkv)                                   # [T, (N + 2K) H]
            q, k, v = np.empty((T, N, H), np.float32), np.empty((T, K, H), np.float32), np.empty((T, K, H), np.float32)
            split_rope(qkv, cos, sin, N, K, q, k, v)                                # RoPE on q, k (layers.apply_rope)
            a = np.ascontiguousarray(attention(i, q, k, v)).reshape(T, N * H)       # [T, N H]
            lin.plain(a, w.o, out=x, accumulate=True)                               # x += a @ Wo
            gu = lin.norm(x, w.mlp_norm, w.gate_up)                                 # [T, 2F]
            lin.swiglu(gu, w.down, out=x, accumulate=True)                          # x += swiglu @ Wdown
        if logit_rows is not None:
            x = np.ascontiguousarray(x[logit_rows])                                 # [R, D]
        return lin.norm(x, model.final_norm, fw.lm_head)                            # [R, V]
