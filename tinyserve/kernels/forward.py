"""The fast forward: model.forward's steps with int8 Numba kernels, for a model loaded with a quantised mode
and backend="numba". backend.forward calls it; it returns the same logits as the NumPy reference of the same
quantised weights (tinyserve.quant): W8A8 bit for bit under the same attention, W8A32 within ~1e-6 relative (its
matmuls and norms sum in another order; tests/test_quant.py).

What it does differently, and why each pays (lesson 7 measures them; docs/performance.md has the numbers):
- A layer is three fused Numba calls (kernels/layer.py) around the strategy's attention, for both modes: at decode
  the ~20 NumPy calls and 9 kernel launches of a layer written step by step cost more than their arithmetic.
- Q|K|V are one matrix [D, (N + 2K) H] and gate|up one [D, 2F]: a decode step launches 4 matmuls per layer
  instead of 7, and the small K and V projections (192 columns) no longer pay a kernel launch each.
- The O and down projections add into the residual stream in place (`accumulate=True`): no temporary.
- Everything runs on Numba's thread pool; NumPy's BLAS (used by the attention reference) is held at one thread
  for the whole forward, so two pools never fight over the cores (a many-fold slowdown when they do).
- A step of up to 16 rows that all need logits (decodes of up to 16 sequences, or a speculative verify) whose strategy
  says where its K/V live (backend.forward's `kv_layout`) runs as one call for all layers (kernels/decode_step.py):
  faster at batch 1 than the three calls per layer, which start a parallel loop for every matmul.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import decode_step, isa, single_thread_blas
from .decode_step import DecodeWeights, Packed, PackedLayer
from .layer import (lm_head, lm_head_w8a32, mlp_down, mlp_down_w8a32, post_attention, post_attention_w8a32,
                    pre_attention, pre_attention_w8a32)
from ..model import forward as float32_forward
from ..quant import (B8Linear, BlockLinear, Q5Linear, Q6Linear, S4Linear, S5Linear, S8Linear, act_blocks,
                     dequantize_model, is_w8a8, role_tile)
from .matmul import (W8A8Weights, W8A32Weights, act_blocks_of, b8a8_weights, pack_b8a8, pack_q5a8, pack_q6a8,
                     pack_s4a8, pack_s5a8, pack_s8a8, pack_vnni, pack_w4a8, pack_w8a32, q5a8_weights, q6a8_weights,
                     s4a8_weights, s5a8_weights, s8a8_weights, w4a8_weights)


# SiLU's exp on the three-call W8A8 path. None (the default): fast_exp.exp32 inside mlp_down, the fused decode step's
# own, so a prompt's rows and a decode step's row compute SiLU alike (and attention adds in one order for both:
# kernels/key_chunks.py), a row's logits the same bits whoever shares its step. np.exp: NumPy's, which makes the path
# the NumPy W8A8 reference bit for bit (tests/test_quant.py and others set it to prove that; the reference's SiLU is
# np.exp, and a last-bit difference before rounding to int8 can move an activation a whole int8 step). Why not NumPy
# by default: it runs on one thread while the others idle; exp32 runs in the kernel's parallel row loop. Called as
# silu_exp(x, out=x), into a buffer the forward keeps for all layers.
silu_exp = None

# From this many rows on, a W8A32 forward multiplies float32 copies of the dequantised weights with BLAS instead of
# running the int8 tiles, on the variants where the tiles cannot beat BLAS at many rows: the `generic` ones (plain
# loops LLVM vectorises, no byte dot product): there the tiles are slower than float32 BLAS from a few rows on, while
# at batch 16 decode they are faster, because they read 4x fewer bytes. The copies (4 bytes per weight) are made on
# the first such forward. The other variants' tiles beat BLAS at every row count, so they never take this path.
BLAS_FROM_ROWS = {"generic": 32}


@dataclass(slots=True)
class FastWeights:
    mode: str              # a QuantMode's name with kernels (quant.KERNEL_MODES)
    layers: list[PackedLayer]   # views into `decode`'s stacked arrays (no second copy of the weights)
    lm_head: Packed        # [D, V]
    decode: DecodeWeights
    float32: object | None = None   # quant.dequantize_model(model), made on first use (BLAS_FROM_ROWS)
    decode_entries: dict = field(default_factory=dict)   # the fused step's compiled entry by argument types
                                                           # (decode_step._run_kernel)


def _pack(mode: str, *qs, tile: type | None = None) -> Packed:
    """Quantised matrices side by side (same input) -> one packed matrix of their kind: a fused projection. Blocks
    of 32 (quant.BlockLinear) pack on the tile `tile` names (a block class, quant.role_tile's answer for the role
    they belong to; None: theirs, role_tile of these matrices): B8Linear the byte tile (a nibble is a byte: a fused
    or stacked matrix of mixed formats reads 8 bits a weight), S8Linear it without m (Q8_0: d only), Q5Linear the
    5-bit tile, S5Linear it without m (Q5_0), Q6Linear the 6-bit tile (Q6_K's own blocks), S4Linear the symmetric
    nibble tile (d only, Q4_0), Q4Linear W4A8's; int8 ones as W8A8 when the model's mode rounds the activations to int8 too (a W4A8 model's LM
    head among them), else as W8A32."""
    if isinstance(qs[0], (BlockLinear, Q6Linear)):
        tile = tile or role_tile(list(qs))
        if tile in (B8Linear, S8Linear):           # a Q6_K part beside other formats: requantized to bytes
            qs = [q.on_bytes() if isinstance(q, Q6Linear) else q for q in qs]
        cat = lambda f: np.concatenate([getattr(q, f) for q in qs], axis=1)        # noqa: E731
        if tile is Q6Linear:
            return q6a8_weights(pack_q6a8(cat("q"), cat("sc"), cat("d")))
        if tile is S8Linear:
            return s8a8_weights(pack_s8a8(cat("q"), cat("d")))
        if tile is B8Linear:
            return b8a8_weights(pack_b8a8(cat("q"), cat("d"), cat("m")))
        if tile is S5Linear:
            return s5a8_weights(pack_s5a8(cat("q"), cat("d")))
        if tile is Q5Linear:
            return q5a8_weights(pack_q5a8(cat("q"), cat("d"), cat("m")))
        if tile is S4Linear:
            return s4a8_weights(pack_s4a8(cat("q"), cat("d")))
        return w4a8_weights(pack_w4a8(cat("q"), cat("d"), cat("m")))
    wq = np.concatenate([q.wq for q in qs], axis=1)                                  # [D_in, sum O]
    scale = np.concatenate([q.scale for q in qs])
    if not is_w8a8(mode):
        return W8A32Weights(pack_w8a32(wq), act_blocks_of(1), scale)
    return W8A8Weights(pack_vnni(wq), act_blocks_of(act_blocks(mode, wq.shape[0])), scale)


def _stack(matrices: list[Packed]) -> tuple[Packed, list[Packed]]:
    """One matrix of every layer -> the same kind with every array stacked [L, ...], and each layer's matrix as
    views into that stack."""
    stacked = type(matrices[0])(*(np.stack(arrays) for arrays in zip(*matrices)))
    return stacked, [type(stacked)(*(a[i] for a in stacked)) for i in range(len(matrices))]


def prepare(model) -> FastWeights:
    """Pack a quantised model's weights for the kernels (once per model, before anything is timed)."""
    mode = model.quant

    def role(*fields):     # one matrix of every layer, stacked: every layer's on the role's one tile (role_tile)
        mats = [[getattr(w, f) for f in fields] for w in model.layers]
        tile = role_tile([q for qs in mats for q in qs])
        return _stack([_pack(mode, *qs, tile=tile) for qs in mats])
    qkv, qkv_l = role("wq", "wk", "wv")
    o, o_l = role("wo")
    gate_up, gate_up_l = role("w_gate", "w_up")
    down, down_l = role("w_down")
    layers = [PackedLayer(w.attn_norm, qkv_l[i], o_l[i], w.mlp_norm, gate_up_l[i], down_l[i])
              for i, w in enumerate(model.layers)]
    stacked = PackedLayer(np.stack([w.attn_norm for w in model.layers]), qkv, o,
                          np.stack([w.mlp_norm for w in model.layers]), gate_up, down)
    head = _pack(mode, model.lm_head_q)
    return FastWeights(mode, layers, head, DecodeWeights(stacked, model.final_norm, head))


def fast_forward(model, tokens: np.ndarray, positions: np.ndarray, attention, logit_rows=None,
                 kv_layout=None) -> np.ndarray:
    """model.forward for quantised weights on the Numba backend (same arguments, same result up to float order).

    A layer is three fused Numba calls (kernels/layer.py) around the strategy's attention: the int8-activation
    ones (W8A8 and W4A8, the matmul's tile picked by each matrix's kind) or the W8A32 ones."""
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
                pre_attention(x, w.attn_norm, eps, w.qkv, cos, sin, N, K, q, k, v)
            else:
                pre_attention_w8a32(x, w.attn_norm, eps, w.qkv, cos, sin, N, K, q, k, v)
            a = np.ascontiguousarray(attention(i, q, k, v)).reshape(T, N * H)     # [T, N H]
            if w8a8:    # x += a @ Wo; gu = norm(x) @ [gate|up]; x += silu(gate) * up @ Wdown
                post_attention(x, a, w.o, w.mlp_norm, eps, w.gate_up, gu)
                if silu_exp is not None:                                            # NumPy's exp, as layers.silu
                    silu_exp(np.negative(gu[:, :F], out=e), out=e)
                mlp_down(x, gu, e, silu_exp is None, w.down)
            else:
                post_attention_w8a32(x, a, w.o, w.mlp_norm, eps, w.gate_up, gu)
                mlp_down_w8a32(x, gu, w.down)
        if logit_rows is not None:
            x = np.ascontiguousarray(x[logit_rows])                                 # [R, D]
        if w8a8:
            return lm_head(x, model.final_norm, eps, fw.lm_head)                   # [R, V]
        return lm_head_w8a32(x, model.final_norm, eps, fw.lm_head)
