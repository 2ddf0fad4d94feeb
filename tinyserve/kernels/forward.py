"""The fast forward: model.forward's steps with int8 Numba kernels, for a model loaded with a quantised mode
and backend="numba". backend.forward calls it; it returns the same logits as the NumPy reference of the same
quantised weights (tinyserve.quant): W8A8 bit for bit under the same attention, W8A32 within ~1e-6 relative (its
matmuls and norms sum in another order; tests/test_quant.py).

What it does differently, and why each pays (lesson 7 measures them):
- A layer is three fused Numba calls (kernels/layer.py) around the strategy's attention, for both modes: at decode
  the ~20 NumPy calls and 9 kernel launches of a layer written step by step cost more than their arithmetic.
- Q|K|V are one matrix [D, (N + 2K) H] and gate|up one [D, 2F]: a decode step launches 4 matmuls per layer
  instead of 7, and the small K and V projections (192 columns) no longer pay a kernel launch each.
- The O and down projections add into the residual stream in place (`accumulate=True`): no temporary.
- Everything runs on Numba's thread pool; NumPy's BLAS (used by the attention reference) is held at one thread
  for the whole forward, so two pools never fight over the 2 cores (docs/performance.md: that trap costs ~10x).
- A step of up to 16 rows that all need logits (decodes of up to 16 sequences, or a speculative verify) whose strategy
  says where its K/V live (backend.forward's `kv_layout`) runs as one call for all layers (kernels/decode_step.py):
  1.2-1.5x faster at batch 1 than the three calls per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import decode_step, isa, single_thread_blas
from .layer import (lm_head, lm_head_w8a32, mlp_down, mlp_down_w8a32, post_attention, post_attention_w8a32,
                    pre_attention, pre_attention_w8a32)
from ..model import forward as float32_forward
from ..quant import Q4_GROUP, Q4Linear, act_blocks, dequantize_model, is_w8a8
from .matmul import block_sums, pack_vnni, pack_w4a8, pack_w8a32


# SiLU's exp on the three-call W8A8 path. None (the default): fast_exp.exp32 inside mlp_down, the fused decode step's
# own, so a prompt's rows and a decode step's row compute SiLU alike (and attention adds in one order for both:
# kernels/key_chunks.py), a row's logits the same bits whoever shares its step. np.exp: NumPy's, which makes the path
# the NumPy W8A8 reference bit for bit (tests/test_quant.py and others set it to prove that; the reference's SiLU is
# np.exp, and a last-bit difference before rounding to int8 can move an activation a whole int8 step). Why not NumPy
# by default: it ran on one thread while the other idled (~6 % of a prefill; docs/performance.md, "Why the kernels'
# constants are what they are"); exp32 runs in the kernel's parallel row loop. Called as
# silu_exp(x, out=x), into a buffer the forward keeps for all layers.
silu_exp = None

# From this many rows on, a W8A32 forward multiplies float32 copies of the dequantised weights with BLAS instead of
# running the int8 tiles, on the variants where the tiles cannot beat BLAS at many rows: the `generic` ones (plain
# loops LLVM vectorises, no byte dot product): there the tiles reach 0.5-0.8x float32 BLAS at 8-512 rows, while at
# batch 16 decode they are ~2x float32, because they read 4x fewer bytes (docs/performance.md, "Why the kernels'
# constants are what they are"). The copies (4 bytes per weight) are made on the first such forward. The other
# variants' tiles beat BLAS at every row count measured, so they never take this path.
BLAS_FROM_ROWS = {"generic": 32}


@dataclass(slots=True)
class PackedLinear:
    """One quantised matrix [D_in, O] laid out for its kernel."""
    w: np.ndarray          # W8A8: pack_vnni -> [O/16, D_in/4*64]; W8A32: pack_w8a32 -> [O/16, D_in, 16] (int8)
    wsum: np.ndarray       # [nb, O] int32: the weights summed over each activation block (matmul.block_sums; W8A8
                           # undoes the +128 activation offset with it); nb = 1 for "int8" and "w8a8"
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
    mode: str              # "int8" | "w8a8" | "w8a8-64" | "w4a8"
    layers: list[PackedLayer]
    lm_head: PackedLinear  # [D, V]
    # the same arrays stacked over the L layers, for the fused decode step (kernels/decode_step.py), whose one call
    # walks every layer: (attn_norm, qkv w, wsum, scale, o w, wsum, scale, mlp_norm, gate_up w, wsum, scale, down w,
    # wsum, scale), each [L, ...] (packed weights as [L, O/16, bytes per block]); the layers' arrays are views of them
    stacked: tuple
    head: tuple            # (final_norm, lm_head w [V/16, bytes per block], wsum, scale)
    float32: object | None = None   # quant.dequantize_model(model), made on first use (BLAS_FROM_ROWS)


def _pack(mode: str, *qs) -> PackedLinear:
    """QuantizedLinears side by side (same input) -> one packed matrix: a fused projection."""
    if isinstance(qs[0], Q4Linear):                     # w4a8's layers: [O/16, D_in/32, 320] (3-d: the kernels'
        cat = lambda f: np.concatenate([getattr(q, f) for q in qs], axis=1)        # noqa: E731   sign of W4A8)
        return PackedLinear(pack_w4a8(cat("q"), cat("d"), cat("m")), np.zeros((qs[0].q.shape[0] // Q4_GROUP, 0),
                                                                             np.int32), np.zeros(0, np.float32))
    wq = np.concatenate([q.wq for q in qs], axis=1)                                  # [D_in, sum O]
    scale = np.concatenate([q.scale for q in qs])
    if not is_w8a8(mode):
        return PackedLinear(pack_w8a32(wq), block_sums(wq, 1), scale)
    return PackedLinear(pack_vnni(wq), block_sums(wq, act_blocks(mode, wq.shape[0])), scale)


def _stack(linears: list[PackedLinear]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One matrix of every layer -> (w [L, O/16, bytes per block], wsum [L, nb, O], scale [L, O]); each layer's
    PackedLinear then keeps views into the stack (no second copy of the weights)."""
    w = np.stack([p.w if p.w.ndim == 3 else p.w.reshape(p.w.shape[0], -1) for p in linears])
    wsum, scale = np.stack([p.wsum for p in linears]), np.stack([p.scale for p in linears])
    for i, p in enumerate(linears):
        p.w, p.wsum, p.scale = w[i].reshape(p.w.shape), wsum[i], scale[i]
    return w, wsum, scale


def prepare(model) -> FastWeights:
    """Pack a quantised model's weights for the kernels (once per model; ~1 s for SmolLM2)."""
    mode = model.quant
    layers = [PackedLayer(w.attn_norm, _pack(mode, w.wq, w.wk, w.wv), _pack(mode, w.wo), w.mlp_norm,
                          _pack(mode, w.w_gate, w.w_up), _pack(mode, w.w_down)) for w in model.layers]
    stacked = (np.stack([w.attn_norm for w in layers]), *_stack([w.qkv for w in layers]),
               *_stack([w.o for w in layers]), np.stack([w.mlp_norm for w in layers]),
               *_stack([w.gate_up for w in layers]), *_stack([w.down for w in layers]))
    head = _pack(mode, model.lm_head_q)
    return FastWeights(mode, layers, head, stacked,
                       (model.final_norm, head.w.reshape(head.w.shape[0], -1), head.wsum, head.scale))


def fast_forward(model, tokens: np.ndarray, positions: np.ndarray, attention, logit_rows=None,
                 kv_layout=None) -> np.ndarray:
    """model.forward for quantised weights on the Numba backend (same arguments, same result up to float order).

    A layer is three fused Numba calls (kernels/layer.py) around the strategy's attention; the W8A8 and W8A32
    kernels differ in their arguments (W8A8 also needs each matrix's column sums)."""
    if model.fast is None:
        model.fast = prepare(model)
    fw: FastWeights = model.fast
    if decode_step.usable(len(tokens), kv_layout, logit_rows):   # kv_cache and the Engine pass one with their
        with single_thread_blas():                                 # default attention
            logits = decode_step.decode_step(model, tokens, kv_layout)
        if logits is not None:
            return logits
    w8a8 = is_w8a8(fw.mode)
    if not w8a8 and len(tokens) >= BLAS_FROM_ROWS.get(isa.NAME, len(tokens) + 1):
        if fw.float32 is None:
            fw.float32 = dequantize_model(model)
        return float32_forward(fw.float32, tokens, positions, attention, logit_rows)
    cfg = model.config
    T, N, K, H, F = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate_size
    eps = np.float32(cfg.norm_eps)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]                # [T, H/2]
    x = model.embed[tokens]                                                         # [T, D] (a copy: ours to update)
    gu = np.empty((T, 2 * F), np.float32)                                           # [T, 2F], reused by every layer
    e = np.empty((T, F), np.float32) if w8a8 else None                              # exp(-gate), likewise
    with single_thread_blas():
        for i, w in enumerate(fw.layers):
            q, k, v = np.empty((T, N, H), np.float32), np.empty((T, K, H), np.float32), np.empty((T, K, H), np.float32)
            if w8a8:    # norm -> quantise -> [Q|K|V] -> RoPE
                pre_attention(x, w.attn_norm, eps, w.qkv.w, w.qkv.wsum, w.qkv.scale, cos, sin, N, K, q, k, v)
            else:
                pre_attention_w8a32(x, w.attn_norm, eps, w.qkv.w, w.qkv.scale, cos, sin, N, K, q, k, v)
            a = np.ascontiguousarray(attention(i, q, k, v)).reshape(T, N * H)     # [T, N H]
            if w8a8:    # x += a @ Wo; gu = norm(x) @ [gate|up]; x += silu(gate) * up @ Wdown
                post_attention(x, a, w.o.w, w.o.wsum, w.o.scale, w.mlp_norm, eps, w.gate_up.w, w.gate_up.wsum,
                               w.gate_up.scale, gu)
                if silu_exp is not None:                                            # NumPy's exp, as layers.silu
                    silu_exp(np.negative(gu[:, :F], out=e), out=e)
                mlp_down(x, gu, e, silu_exp is None, w.down.w, w.down.wsum, w.down.scale)
            else:
                post_attention_w8a32(x, a, w.o.w, w.o.scale, w.mlp_norm, eps, w.gate_up.w, w.gate_up.scale, gu)
                mlp_down_w8a32(x, gu, w.down.w, w.down.scale)
        if logit_rows is not None:
            x = np.ascontiguousarray(x[logit_rows])                                 # [R, D]
        p = fw.lm_head
        if w8a8:
            return lm_head(x, model.final_norm, eps, p.w, p.wsum, p.scale)         # [R, V]
        return lm_head_w8a32(x, model.final_norm, eps, p.w, p.scale)
