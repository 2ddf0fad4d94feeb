"""Lesson 7: int8 weights (and activations) — the NumPy reference of the fast path.

A decode step at batch 1 reads every weight once and does two FLOPs with it: its speed is the memory bandwidth
divided by the bytes of the weights. int8 instead of float32 reads 4x fewer bytes. Symmetric, per output channel:

    W[:, o] ~ wq[:, o] * scale[o]        scale[o] = max_i |W[i, o]| / 127,  wq = round(W / scale) in [-127, 127]

Four int8 modes (`quantize_model(model, mode)`), and a 4-bit one:
- "int8" (W8A32, weight-only): y = (x @ wq) * scale, activations stay float32.
- "w8a8": the activations are quantised too, one scale per row (token), at run time ("dynamic"):
      x[t, :] ~ xq[t, :] * sx[t],  sx[t] = max_i |x[t, i]| / 127
      y[t, o] = float32(sum_i xq[t, i] * wq[i, o]) * sx[t] * scale[o]
  the sum is an exact integer (int32; at most D * 127 * 127 = 25 M for D = 1536, far below 2^31), so the
  kernels (kernels/matmul.py) reproduce this reference bit for bit.
- "w8a8-64": the same, with one activation scale per block of 64 inputs of a row (ACT_BLOCKS), as llama.cpp
  quantises activations (blocks of 32 there). A token's largest activation is many times its RMS in SmolLM2
  (lesson 7 measures it), so one scale per row leaves the typical entry only a few int8 steps; per block, only the
  outlier's own block pays.
  Each block's dot product is an exact integer; the blocks are added in float32, in block order:
      y[t, o] = (sum_b float32(sum_{i in b} xq[t, i] * wq[i, o]) * sx[t, b]) * scale[o]
  (lesson 7, "outliers": accuracy and speed of the three, and of SmoothQuant, which moves the outliers into the
  weights instead: `smooth_model`.)
- "w4a8": the layers' weights as SmolLM2's GGUF ships them, Q4_1 (4-bit, a scale and a minimum per 32 inputs),
  recovered exactly from the float32 weights (`quantize_q4_1`), times int8 activations per 32: the model's own
  weights at 5 bits each (4-bit values plus a float16 scale and minimum per 32), so a decode step reads ~95 MB
  instead of int8's ~135 (see "W4A8" below). The default (backend.default_quant) for weights that are Q4_1 already,
  on the instruction sets where it is fastest (docs/performance.md, "The quantisation modes, measured").
- "gguf": a GGUF file's matrices as the file holds them, each on the tile of its format (W4A8's nibbles, or the
  same arithmetic on whole bytes), int8 activations per 32 (see '"gguf": every matrix as its file holds it' below).
  The default for a model loaded from a GGUF file.
Why the int8 weights keep one scale per output channel, not per group of 32/64 inputs: it costs little accuracy on
SmolLM2 (lesson 7 measures both), and one weight scale per output keeps each block's sum an integer dot product.

A `QuantizedLinear` stands where a float32 matrix stood: `x @ layer.wq` in model.forward works unchanged (NumPy
hands `@` over to `QuantizedLinear.__rmatmul__`), which keeps model.forward the one readable reference for
every mode. The quantised tensors are cached on disk beside the float32 ones (`model.int8.safetensors`), so a
second start does not quantise again.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from .layers import causal_attention
from .model import FLOAT32, LayerWeights, Model, forward as model_forward

Q4_GROUP = 32      # w4a8: inputs per Q4_1 block (one scale d and one minimum m), and activation values per scale


# --- the modes: one registry --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class QuantMode:
    """What `--quant NAME` means, in one place. Model.quant and QuantizedLinear.mode hold the name; everything else
    about a mode is read from here (get_mode), never spelled out again as a string comparison."""
    name: str                    # the one spelling: --quant, Model.quant, QuantizedLinear.mode, --json's "quant"
    label: str                   # how the summary line names it
    bytes_per_weight: float      # a layer weight as a decode step reads it (scales aside for the int8 modes)
    int8_activations: bool       # activations rounded to int8 too: an integer dot product (W8A8, W4A8)
    act_block: int | None        # with int8 activations: values per activation scale (None: one per row)
    kernels: str | None          # the Numba kernels that multiply it (kernels/matmul.py); None: float32, no kernels
    # the accuracy against float32 on SmolLM2 it is held to (tests/test_quant_accuracy.py): teacher-forced top-1
    # agreement at least top1_min, perplexity at most ppl_ratio_max times float32's
    top1_min: float = 1.0
    ppl_ratio_max: float = 1.0


NONE = QuantMode(FLOAT32, "float32", 4.0, False, None, None)
INT8 = QuantMode("int8", "int8 weights (W8A32)", 1.0, False, None, "w8a32", top1_min=0.95, ppl_ratio_max=1.02)
W8A8 = QuantMode("w8a8", "int8 weights and activations (W8A8)", 1.0, True, None, "w8a8",
                 top1_min=0.80, ppl_ratio_max=1.10)
W8A8_64 = QuantMode("w8a8-64", "int8 weights and activations, a scale per 64 (W8A8-64)", 1.0, True, 64, "w8a8",
                    top1_min=0.95, ppl_ratio_max=1.02)
W4A8 = QuantMode("w4a8", "the GGUF's 4-bit weights (Q4_1) and int8 activations (W4A8)", 20 / 32, True, Q4_GROUP,
                 "w4a8", top1_min=0.95, ppl_ratio_max=1.02)   # 16 bytes of nibbles + float16 d and m per 32
GGUF = QuantMode("gguf", "a GGUF's own blocks, each matrix on the tile that holds it (4-bit or byte weights) and int8 "
                 "activations", 34 / 32, True, Q4_GROUP, "gguf", top1_min=0.95, ppl_ratio_max=1.02)
#                (bytes_per_weight: a float matrix requantized by Q8_0's rule, on the byte tile without a minimum:
#                32 bytes + a float16 d per 32; a file's own blocks take their tile's, W4A8's for nibbles)
MODES = {m.name: m for m in (NONE, INT8, W8A8, W8A8_64, W4A8, GGUF)}
QUANT_MODES = tuple(MODES)                                      # the names, float32's first
KERNEL_MODES = tuple(m.name for m in MODES.values() if m.kernels)   # the modes the Numba kernels run
AUTO = "auto"                     # --quant auto: default_quant picks one of QUANT_MODES for this CPU and model
# the modes with int8 activations: activation values per scale (None: the whole row)
ACT_BLOCKS = {m.name: m.act_block for m in MODES.values() if m.int8_activations}


def get_mode(name: str) -> QuantMode:
    """The QuantMode called `name`, or a clear error naming the choices."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {name!r}") from None


def is_w8a8(mode: str) -> bool:
    """Are the activations quantised to int8 too (an integer product: W8A8, and W4A8's 4-bit x 8-bit)?"""
    return get_mode(mode).int8_activations


def act_blocks(mode: str, d_in: int) -> int:
    """How many activation scales a row of d_in inputs has in a W8A8 mode (1: one per row)."""
    block = ACT_BLOCKS[mode] or d_in
    if d_in % block or block % 4:
        raise ValueError(f"{mode}: {d_in} inputs do not split into blocks of {block} (a multiple of 4)")
    return d_in // block
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")   # the LayerWeights fields that are matmuls


@dataclass(slots=True)
class QuantizedLinear:
    """A [D_in, O] weight matrix as int8 + one float32 scale per output channel; `x @ self` multiplies."""
    wq: np.ndarray       # [D_in, O] int8
    scale: np.ndarray    # [O] float32
    mode: str            # a QuantMode's name: INT8 (W8A32), W8A8 or W8A8_64 (see the module docstring)
    planes: int = 1      # int8 activations: 1, or 2 (two_planes below: Gemma 3's MLP input)

    __array_ufunc__ = None   # tells NumPy not to treat us as an array: `x @ q` then calls q.__rmatmul__(x)

    @property
    def shape(self) -> tuple[int, int]:
        return self.wq.shape

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.scale.nbytes

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:  # [T, D_in] float32 -> [T, O] float32
        return two_planes(x, self, matmul_reference)

    def dequantize(self) -> np.ndarray:  # -> [D_in, O] float32
        return self.wq.astype(np.float32) * self.scale


def quantize_weight(w: np.ndarray, mode: str = INT8.name) -> QuantizedLinear:
    """[D_in, O] float32 -> QuantizedLinear: symmetric int8, one scale per output channel (column)."""
    amax = np.abs(w).max(axis=0)                                                     # [O]
    scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    wq = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)   # -128 is never used: keeps the range symmetric
    return QuantizedLinear(np.ascontiguousarray(wq), scale, mode)  # (w may be a transposed view: embed.T)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dynamic per-row activation quantisation: x [T, D] float32 -> xq [T, D] int8, sx [T] float32.

    float32 throughout and rounding half up, exactly as kernels.matmul.quantize_rows (so both get the same xq)."""
    amax = np.abs(x).max(axis=1)                                                     # [T]
    sx = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    xq = np.clip(np.floor(x / sx[:, None] + np.float32(0.5)), -127, 127).astype(np.int8)
    return xq, sx


def quantize_blocks(x: np.ndarray, n_blocks: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize_rows for each of n_blocks equal runs of a row: x [T, D] -> xq [T, D] int8, sx [T, n_blocks]."""
    T, D = x.shape
    xq, sx = quantize_rows(np.ascontiguousarray(x).reshape(T * n_blocks, D // n_blocks))
    return xq.reshape(T, D), sx.reshape(T, n_blocks)


def matmul_reference(x: np.ndarray, q: QuantizedLinear) -> np.ndarray:
    """x [T, D_in] float32 @ q -> [T, O] float32, the readable definition the kernels are tested against."""
    if not is_w8a8(q.mode):
        return (x @ q.wq.astype(np.float32)) * q.scale
    nb = act_blocks(q.mode, q.wq.shape[0])
    xq, sx = quantize_blocks(x, nb)                                                  # sx [T, nb]
    b = q.wq.shape[0] // nb
    y = np.zeros((x.shape[0], q.wq.shape[1]), np.float32)
    for j in range(nb):                      # one exact integer dot product per block, added in float32 in order
        # float64 BLAS is exact here: every partial sum is an integer below 2^53, so this IS the int32 result
        acc = (xq[:, j * b:(j + 1) * b].astype(np.float64) @ q.wq[j * b:(j + 1) * b].astype(np.float64))
        y = y + acc.astype(np.int32).astype(np.float32) * sx[:, j:j + 1]            # [T, O]
    return y * q.scale


# --- W4A8: the layers' weights as the GGUF ships them (Q4_1), int8 activations -------------------------------------
#
# SmolLM2's only offline copy stores every layer matrix as Q4_1 (weights.py): per run of 32 inputs of an output
# channel, 32 nibbles q in 0..15 and two float16, d and m, with w = d * q + m. The float32 weights are those values
# exactly, so `quantize_q4_1` (llama.cpp's rule: m = min, d = (max - min) / 15 rounded to float16, q = round((w -
# m) / d)) gets back the very blocks, and w4a8 computes with the model's own weights at 5 bits each (4-bit values
# plus a float16 scale and minimum per 32): ~66 MB for the layers where int8 reads ~106 MB. Only the activations
# are rounded (int8 per run of 32, as w8a8-64 per 64):
#     y[t, o] = sum_b float32(sum_{i in b} xq[t, i] q[i, o]) * (d[b, o] sx[t, b]) + m[b, o] * xs[t, b]
#     xs[t, b] = sx[t, b] * sum_{i in b} xq[t, i]
# each block's dot product an exact integer, the blocks added in float32 in order: kernels/int4_dot.py's tile
# reproduces it bit for bit. The LM head (a Q8_0 table in the GGUF) stays int8 per channel, activations per 32.
# The same arithmetic on whole bytes (B8Linear, the byte tile) and on 5-bit values (Q5Linear) runs the GGUF formats of
# 5 to 8 bits: "gguf" below.

@dataclass
class BlockLinear:
    """A [D_in, O] weight matrix as blocks of 32 inputs: W[i, o] = d[i // 32, o] * q[i, o] + m[i // 32, o]; the
    arithmetic of matmul_reference_w4a8, whatever the width of q (Q4Linear: nibbles, B8Linear: bytes)."""
    q: np.ndarray        # [D_in, O] uint8
    d: np.ndarray        # [D_in / 32, O] float32 (float16 values)
    m: np.ndarray        # [D_in / 32, O] float32 (float16 values)
    mode: str = W4A8.name
    planes: int = 1      # 1, or 2 (two_planes below: Gemma 3's MLP input)
    BITS: ClassVar[int] = 8

    __array_ufunc__ = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:              # as the kernels hold it: q at BITS bits, d and m as float16
        return self.q.size * self.BITS // 8 + (self.d.size + self.m.size) * 2

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return two_planes(x, self, matmul_reference_w4a8)

    def dequantize(self) -> np.ndarray:
        D, O = self.q.shape
        b = self.q.reshape(D // Q4_GROUP, Q4_GROUP, O).astype(np.float32)
        return (self.d[:, None] * b + self.m[:, None]).reshape(D, O)


class Q4Linear(BlockLinear):
    """Q4_1-style blocks (q 0..15): the W4A8 tile, two values a byte (kernels/int4_dot.py)."""
    BITS: ClassVar[int] = 4


class S4Linear(Q4Linear):
    """Nibble blocks whose minimum is -8 d throughout (Q4_0: w = d (q - 8)): the symmetric nibble tile, which keeps d
    only (kernels.matmul.pack_s4a8: 18 bytes per 32 weights, Q4_0's own size, against 20 with m). m is kept here
    for the reference's arithmetic (matmul_reference_w4a8), which is the same: -8 d is exact in float16."""

    @property
    def nbytes(self) -> int:
        return self.q.size * self.BITS // 8 + self.d.size * 2


def nibble_linear(q: np.ndarray, d: np.ndarray, m: np.ndarray, mode: str) -> Q4Linear:
    """Nibble blocks -> S4Linear where every minimum is -8 d (any format's blocks, Q4_0's always), else Q4Linear."""
    kind = S4Linear if np.array_equal(m, np.float32(-8) * d) else Q4Linear
    return kind(q, d, m, mode)


class B8Linear(BlockLinear):
    """Blocks of whole bytes (q 0..255): the byte tile (kernels.matmul.pack_b8a8), for a fused role whose parts are of
    several formats (a nibble or a Q5 value is a byte too; role_tile) and for bytes whose minimum is not -128 d."""


class S8Linear(B8Linear):
    """Byte blocks whose minimum is -128 d throughout (Q8_0's q + 128, and what is requantized by its rule:
    quantize_q8_blocks): the byte tile without m (kernels.matmul.pack_s8a8: 34 bytes per 32 weights, Q8_0's own,
    against 36 with m). m is kept for the reference's arithmetic, which is the same: -128 d is exact in float16."""

    @property
    def nbytes(self) -> int:
        return self.q.size + self.d.size * 2


class Q5Linear(BlockLinear):
    """5-bit blocks (q 0..31: Q5_1, Q5_K): the 5-bit tile (kernels.matmul.pack_q5a8: the low nibbles and a fifth bit
    per weight beside d and m, 6 bits a weight as Q5_1 in the file)."""
    BITS: ClassVar[int] = 5


class S5Linear(Q5Linear):
    """5-bit blocks whose minimum is -16 d throughout (Q5_0: w = d (q - 16)): the 5-bit tile without m
    (kernels.matmul.pack_s5a8: 22 bytes per 32 weights, Q5_0's own)."""

    @property
    def nbytes(self) -> int:
        return self.q.size * self.BITS // 8 + self.d.size * 2


def byte_linear(q: np.ndarray, d: np.ndarray, m: np.ndarray, mode: str) -> B8Linear:
    """Byte blocks -> S8Linear where every minimum is -128 d (Q8_0's always), else B8Linear."""
    kind = S8Linear if np.array_equal(m, np.float32(-128) * d) else B8Linear
    return kind(q, d, m, mode)


def five_linear(q: np.ndarray, d: np.ndarray, m: np.ndarray, mode: str) -> Q5Linear:
    """5-bit blocks -> S5Linear where every minimum is -16 d (Q5_0's always), else Q5Linear."""
    kind = S5Linear if np.array_equal(m, np.float32(-16) * d) else Q5Linear
    return kind(q, d, m, mode)


def quantize_q4_1(w: np.ndarray) -> Q4Linear:
    """[D_in, O] float32 -> Q4Linear by llama.cpp's Q4_1 rule; exact (dequantize() == w) on weights that are Q4_1
    already, as SmolLM2's layers are."""
    D, O = w.shape
    if D % Q4_GROUP:
        raise ValueError(f"w4a8: {D} inputs do not split into blocks of {Q4_GROUP}")
    b = np.ascontiguousarray(w, np.float32).reshape(D // Q4_GROUP, Q4_GROUP, O)
    lo, hi = b.min(axis=1), b.max(axis=1)
    d = ((hi - lo) / np.float32(15)).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.rint((b - m[:, None]) / d[:, None]), 0)
    return Q4Linear(np.clip(q, 0, 15).astype(np.uint8).reshape(D, O), d, m)


def matmul_reference_w4a8(x: np.ndarray, q: BlockLinear) -> np.ndarray:
    """x [T, D_in] float32 @ q -> [T, O] float32: the readable definition kernels/int4_dot.py is tested against."""
    T, D = x.shape
    nb = D // Q4_GROUP
    xq, sx = quantize_blocks(x, nb)                                                  # sx [T, nb]
    xs = sx * xq.reshape(T, nb, Q4_GROUP).sum(axis=2, dtype=np.int32).astype(np.float32)
    y = np.zeros((T, q.q.shape[1]), np.float32)
    for j in range(nb):
        blk = slice(j * Q4_GROUP, (j + 1) * Q4_GROUP)
        dot = (xq[:, blk].astype(np.float64) @ q.q[blk].astype(np.float64)).astype(np.int32).astype(np.float32)
        y = y + (dot * (q.d[j] * sx[:, j:j + 1]) + q.m[j] * xs[:, j:j + 1])
    return y


@dataclass
class Q6Linear:
    """A [D_in, O] matrix as Q6_K's own blocks: W[i, o] = d[i // 256, o] * sc[i // 16, o] * (q[i, o] - 32), the 6-bit
    tile (kernels.matmul.pack_q6a8: 6.5625 bits a weight, as the file). Its arithmetic, matmul_reference_q6: per
    block of 32 inputs the integer sum over its two halves of 16 of sc times the half's dot product, then times d
    and the activation scale: no minimum, and each scale applied to an exact integer."""
    q: np.ndarray        # [D_in, O] uint8: 0..63
    sc: np.ndarray       # [D_in / 16, O] int8
    d: np.ndarray        # [D_in / 256, O] float32 (float16 values)
    mode: str = GGUF.name
    planes: int = 1      # 1, or 2 (two_planes below: Gemma 3's MLP input)
    Q6_OFFSET: ClassVar[int] = 32

    __array_ufunc__ = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:              # as the tile holds them: q at 6 bits, sc int8, d float16
        return self.q.size * 6 // 8 + self.sc.size + self.d.size * 2

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:
        return two_planes(x, self, matmul_reference_q6)

    def dequantize(self) -> np.ndarray:   # -> [D_in, O] float32, gguf_quants.dequantize's values (its order)
        D, O = self.q.shape
        ds = np.repeat(self.d, 16, axis=0) * self.sc.astype(np.float32)                 # [D/16, O]
        return (ds[:, None] * (self.q.reshape(D // 16, 16, O).astype(np.float32) - 32)).reshape(D, O)

    def on_bytes(self) -> "B8Linear":
        """The byte tile's blocks by Q8_0's rule, for a fused role that mixes Q6_K with other formats (role_tile)."""
        return quantize_q8_blocks(self.dequantize(), self.mode)


def matmul_reference_q6(x: np.ndarray, q: Q6Linear) -> np.ndarray:
    """x [T, D_in] float32 @ q -> [T, O] float32, activations int8 per 32 as matmul_reference_w4a8's:
        acc[t, b, o] = sum_{h in halves of b} sc[h, o] * sum_{i in h} xq[t, i] (q[i, o] - 32)        exact, int32
        y[t, o]      = sum_b float32(acc[t, b, o]) * (d[b // 8, o] * sx[t, b])                        in block order
    the readable definition the 6-bit tile (kernels/int4_dot.py) is tested against, bit for bit."""
    T, D = x.shape
    nb = D // Q4_GROUP
    xq, sx = quantize_blocks(x, nb)                                                  # sx [T, nb]
    qs = q.q.astype(np.float64) - Q6Linear.Q6_OFFSET                                 # [D, O]
    y = np.zeros((T, q.q.shape[1]), np.float32)
    for j in range(nb):
        acc = np.zeros((T, q.q.shape[1]), np.int64)
        for h in (2 * j, 2 * j + 1):                 # float64 BLAS is exact on these integers (below 2^53)
            dot = (xq[:, 16 * h:16 * (h + 1)].astype(np.float64) @ qs[16 * h:16 * (h + 1)]).astype(np.int64)
            acc += q.sc[h].astype(np.int64) * dot
        y = y + acc.astype(np.int32).astype(np.float32) * (q.d[j // 8] * sx[:, j:j + 1])
    return y


# --- two int8 planes: an input that one int8 plane per block rounds too coarsely (lesson 11) ---------------------
# Gemma 3's MLP input (RMSNorm times its (1 + w) weights) rounded to int8 per 32 costs more top-1 agreement with the
# float path than any other matmul's input, through up more than through gate (docs/sliding-window.md, "Where the
# fast path's disagreements come from"). A matrix with planes = 2 takes its input as two int8 planes, the second the
# first's rounding error:
#     x ~ sx1 q1 + sx2 q2,   r = x - sx1 q1 (float32),   (q2, sx2) = the same per-block rounding of r
#     x @ W = (x @ W, the matrix's one-plane arithmetic) + (r @ W, the same)           added in float32, in this order
# No weight byte more: the kernels multiply the second plane right after the first, a few blocks of weights at a
# time, while they are in cache (kernels/block_layer.py, kernels/block_decode.py).

def activation_residual(x: np.ndarray, n_blocks: int) -> np.ndarray:
    """x [T, D] float32 -> r [T, D] float32 = x - sx q, what quantize_blocks(x, n_blocks) leaves out."""
    T, D = x.shape
    xq, sx = quantize_blocks(x, n_blocks)
    return x - (xq.reshape(T, n_blocks, D // n_blocks).astype(np.float32) * sx[:, :, None]).reshape(T, D)


def two_planes(x: np.ndarray, q, matmul) -> np.ndarray:
    """x [T, D_in] @ q by its one-plane reference `matmul`, plus the residual's product when q.planes is 2."""
    y = matmul(x, q)
    if q.planes == 1:
        return y
    D = q.shape[0]
    return y + matmul(activation_residual(x, act_blocks(q.mode, D) if isinstance(q, QuantizedLinear) else
                                          D // Q4_GROUP), q)


def with_mlp_planes(model: Model) -> Model:
    """Gemma 3's block (post_norms) with int8 activations: w_up takes two planes (gate gains nothing from them);
    any other model as is."""
    if not (model.config.post_norms and model.quant != NONE.name and is_w8a8(model.quant)):
        return model
    return dataclasses.replace(model, layers=[dataclasses.replace(w, w_up=dataclasses.replace(w.w_up, planes=2))
                                              for w in model.layers])


def quantize_q8_blocks(w: np.ndarray, mode: str = GGUF.name) -> B8Linear:
    """[D_in, O] float32 -> S8Linear (B8Linear where a -128 d overflows float16) by llama.cpp's Q8_0 rule per 32
    inputs (d = max |w| / 127 rounded to float16,
    q = round(w / d) + 128, m = -128 d): the byte tile for what the file holds as floats (F32, F16, BF16) or in
    blocks the tile cannot hold exactly (Q6_K's scales per 16)."""
    D, O = w.shape
    b = np.ascontiguousarray(w, np.float32).reshape(D // Q4_GROUP, Q4_GROUP, O)
    d = (np.abs(b).max(axis=1) / np.float32(127)).astype(np.float16).astype(np.float32)      # [D/32, O]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.rint(b / d[:, None]), 0)
    q = (np.clip(q, -127, 127) + 128).astype(np.uint8).reshape(D, O)
    return byte_linear(q, d, (np.float32(-128) * d).astype(np.float16).astype(np.float32), mode)


# --- "gguf": every matrix as its file holds it -------------------------------------------------------------------
# A GGUF file's matrices come in blocks of 32 inputs with a scale d and a minimum m (gguf_quants.split_blocks), and
# two tiles multiply such blocks with int8 activations per 32 (the arithmetic of matmul_reference_w4a8): the W4A8
# tile (nibbles) and the byte tile (whole bytes). So each format maps onto one without rounding a weight:
#     Q4_0, Q4_1, Q4_K                -> the nibble tile (Q4_K's d * sc_j and dmin * m_j rounded to float16);
#                                        where every m is -8 d (Q4_0's always), its symmetric form (S4Linear: no m)
#     Q5_0, Q5_1, Q5_K                -> the 5-bit tile (Q5_K's scales likewise rounded to float16); where every m
#                                        is -16 d (Q5_0's always), its symmetric form (S5Linear: no m)
#     Q8_0                            -> the byte tile without m (S8Linear: m = -128 d)
#     Q6_K                            -> the 6-bit tile (Q6Linear: its own q, int8 scales per 16 and d per 256)
#     F32, F16, BF16                  -> the byte tile without m, requantized per 32 by Q8_0's rule
#                                        (quantize_q8_blocks: floats have no blocks)
# A fused role (FUSED_ROLES) runs on one tile over its matrices of every layer (role_tile): nibbles beside 5-bit
# values on the 5-bit tile, any byte part or Q6_K beside other formats on the byte tile with m, its Q6_K parts
# requantized by Q8_0's rule (as before the 6-bit tile).
# A float32 model with no file behind it (Model.gguf_tensors None) takes the last row for every matrix.

NIBBLE_FORMATS = ("Q4_0", "Q4_1", "Q4_K")
FIVE_BIT_FORMATS = ("Q5_0", "Q5_1", "Q5_K")
BYTE_FORMATS = ("Q8_0",)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(np.float32)


def tile_of(type_name: str) -> str:
    """Which tile a GGUF format runs on in the gguf mode: "nibble", "5-bit", "byte", "6-bit" or "byte
    (requantized)"."""
    if type_name == "Q6_K":
        return "6-bit"
    return ("nibble" if type_name in NIBBLE_FORMATS else "5-bit" if type_name in FIVE_BIT_FORMATS else
            "byte" if type_name in BYTE_FORMATS else "byte (requantized)")


ROWS_PER_CHUNK = 4096   # a tensor's rows split (or requantized) at a time: the temporaries of a 128k-row embedding
#                        stay a few tens of MB, and every result is per row, so the chunks change no bit


def file_matrix(info, unpermute_heads: int | None = None) -> BlockLinear | Q6Linear:
    """One GGUF tensor (gguf_file.TensorInfo, [O, D_in] in the file) -> the block matrix [D_in, O] the gguf mode
    multiplies, made from the file's bytes a chunk of rows at a time: a requantized tensor is dequantized only
    chunk by chunk, never whole. unpermute_heads: the file's Q/K rows are llama.cpp's interleaved order
    (gguf_file.unpermute_rope_rows). ValueError on blocks that hold NaN or inf."""
    from .gguf_file import unpermute_rope_rows
    from .gguf_quants import BLOCKS, dequantize, split_blocks
    O, D = info.shape
    if D % Q4_GROUP:
        raise ValueError(f"rows of {D} values do not split into blocks of {Q4_GROUP}")
    per_block, nbytes = BLOCKS[info.type_name]
    raw = info.raw.reshape(O, D // per_block * nbytes)                                 # [O, row bytes]
    head = O // unpermute_heads if unpermute_heads else 1                              # rows of one head
    step = max(1, ROWS_PER_CHUNK // head) * head                                       # whole heads per chunk
    if info.type_name == "Q6_K":
        return _q6_matrix(raw, O, D, step, head, unpermute_heads)
    requantize = tile_of(info.type_name).startswith("byte (")
    q, d, m = np.empty((D, O), np.uint8), np.empty((D // Q4_GROUP, O), np.float32), np.empty((D // Q4_GROUP, O),
                                                                                              np.float32)
    for r0 in range(0, O, step):
        r1 = min(O, r0 + step)
        if requantize:
            w = dequantize(raw[r0:r1].reshape(-1), info.type_name, (r1 - r0, D))      # [rows, D] float32
            if unpermute_heads:
                w = unpermute_rope_rows(w, (r1 - r0) // head)
            if not np.isfinite(w).all():
                raise ValueError("holds NaN or inf values: corrupt file")
            b = quantize_q8_blocks(np.ascontiguousarray(w.T))                          # [D, rows]
            q[:, r0:r1], d[:, r0:r1], m[:, r0:r1] = b.q, b.d, b.m
            continue
        b = split_blocks(raw[r0:r1].reshape(-1), info.type_name, (r1 - r0, D))        # [rows, D], [rows, D/32]
        bq, bd, bm = b.q, _f16(b.d), _f16(b.m)
        if unpermute_heads:
            bq, bd, bm = (unpermute_rope_rows(a, (r1 - r0) // head) for a in (bq, bd, bm))
        if not (np.isfinite(bd).all() and np.isfinite(bm).all()):
            raise ValueError("holds NaN or inf values: corrupt file")
        q[:, r0:r1], d[:, r0:r1], m[:, r0:r1] = bq.T, bd.T, bm.T
    if info.type_name in NIBBLE_FORMATS:
        return nibble_linear(q, d, m, GGUF.name)
    if info.type_name in FIVE_BIT_FORMATS:
        return five_linear(q, d, m, GGUF.name)
    return byte_linear(q, d, m, GGUF.name)


def _q6_matrix(raw: np.ndarray, O: int, D: int, step: int, head: int, unpermute_heads: int | None) -> Q6Linear:
    """file_matrix's Q6_K case: the 6-bit tile's blocks, a chunk of rows at a time."""
    from .gguf_file import unpermute_rope_rows
    from .gguf_quants import split_q6_k
    q, sc, d = np.empty((D, O), np.uint8), np.empty((D // 16, O), np.int8), np.empty((D // 256, O), np.float32)
    for r0 in range(0, O, step):
        r1 = min(O, r0 + step)
        b = split_q6_k(raw[r0:r1].reshape(-1), (r1 - r0, D))                           # [rows, D], ...
        bq, bsc, bd = b.q, b.sc, b.d
        if unpermute_heads:
            bq, bsc, bd = (unpermute_rope_rows(a, (r1 - r0) // head) for a in (bq, bsc, bd))
        if not np.isfinite(bd).all():
            raise ValueError("holds NaN or inf values: corrupt file")
        q[:, r0:r1], sc[:, r0:r1], d[:, r0:r1] = bq.T, bsc.T, bd.T
    return Q6Linear(q, sc, d, GGUF.name)


def gguf_fits(config) -> bool:
    """Do the matrices' inputs (D, N H, F) split into the gguf mode's blocks of 32?"""
    return all(n % Q4_GROUP == 0 for n in (config.dim, config.n_heads * config.head_dim, config.intermediate_size))


def quantize_gguf(model: Model) -> Model:
    """The "gguf" mode of a float32 model: every matmul weight (the LM head too) as its file's own blocks (see
    above), or requantized from the floats where no file is behind it (Model.gguf_tensors None)."""
    from .gguf_file import LAYER_TENSORS
    tensors = model.gguf_tensors or {}
    names = {f: n for n, f in LAYER_TENSORS.items()}
    cfg = model.config
    heads = {"wq": cfg.n_heads, "wk": cfg.n_kv_heads} if cfg.arch == "llama" else {}   # as gguf_file unpermutes

    def matrix(name: str, w, heads: int | None = None) -> BlockLinear | Q6Linear:
        info = tensors.get(name)
        return quantize_q8_blocks(w) if info is None else file_matrix(info, heads)
    layers = [dataclasses.replace(w, **{f: matrix(f"blk.{i}.{names[f]}", getattr(w, f), heads.get(f))
                                        for f in MATRICES})
              for i, w in enumerate(model.layers)]
    head = matrix("token_embd.weight" if model.output is None else "output.weight", model.head.T)
    return dataclasses.replace(model, layers=settle_roles(layers), lm_head_q=head, quant=GGUF.name, fast=None)


def settle_roles(layers: list[LayerWeights]) -> list[LayerWeights]:
    """The layers with each Q6_K matrix of a fused role that runs on the byte tile (role_tile: Q6_K beside other
    formats) requantized to it (Q6Linear.on_bytes), so that the model holds what its kernels multiply and the NumPy
    reference computes what the fast path does."""
    for role in FUSED_ROLES:
        if role_tile([getattr(w, f) for w in layers for f in role]) in (B8Linear, S8Linear):
            layers = [dataclasses.replace(w, **{f: getattr(w, f).on_bytes() for f in role
                                                 if isinstance(getattr(w, f), Q6Linear)}) for w in layers]
    return layers


def load_gguf_blocks(g) -> Model:
    """The "gguf" mode straight from a parsed GGUF (gguf_file.GGUFFile), without the float32 model: each matrix
    from its blocks (file_matrix), the embedding read a row at a time (gguf_file.TensorRows), only the norms
    dequantized. The same weights, bit for bit, as quantize_gguf(gguf_file.model_from_gguf(g)), in about the
    memory of the packed weights instead of 4 bytes a parameter first."""
    from .gguf_file import model_from_gguf
    model = model_from_gguf(g, matrix=file_matrix)
    head = file_matrix(g.tensors["token_embd.weight" if model.output is None else "output.weight"])
    return with_mlp_planes(dataclasses.replace(model, layers=settle_roles(model.layers), lm_head_q=head,
                                               quant=GGUF.name, fast=None))


def quantize_model(model: Model, mode: str) -> Model:
    """The same model with every matmul weight quantised (attention, MLP and the tied LM head); the embedding
    lookup table and the norms stay float32 (a lookup reads T rows, not the whole table)."""
    if get_mode(mode) is NONE:
        return model
    check_blocks(model, mode)
    if get_mode(mode) is GGUF:
        return with_mlp_planes(quantize_gguf(model))
    layer_q = quantize_q4_1 if get_mode(mode) is W4A8 else lambda w: quantize_weight(w, mode)
    layers = [dataclasses.replace(w, **{f: layer_q(getattr(w, f)) for f in MATRICES}) for w in model.layers]
    return with_mlp_planes(dataclasses.replace(model, layers=layers, lm_head_q=quantize_weight(model.head.T, mode),
                                               quant=mode, fast=None))


def dequantize_model(model: Model) -> Model:
    """The float32 model whose weights are a quantised model's, dequantised (int8 x scale): quantize_model undone up
    to its rounding. Where the int8 kernels cannot beat float32 BLAS (kernels/forward.py: the generic tiles at
    prefill) the int8 model's forward multiplies these with BLAS; 4 bytes per weight (~540 MB for SmolLM2)."""
    layers = [dataclasses.replace(w, **{f: getattr(w, f).dequantize() for f in MATRICES}) for w in model.layers]
    return dataclasses.replace(model, layers=layers, lm_head_q=model.lm_head_q.dequantize(), quant=NONE.name,
                               backend="numpy", fast=None)


def check_blocks(model: Model, mode: str) -> None:
    """A clear error now, not deep in a forward, if a matrix's inputs do not split into the mode's blocks."""
    if mode in ACT_BLOCKS:
        for f in MATRICES:
            try:
                act_blocks(mode, getattr(model.layers[0], f).shape[0])
            except ValueError as e:
                raise ValueError(f"{f}: {e}") from None


def with_mode(model: Model, mode: str) -> Model:
    """A quantised model switched between INT8, W8A8 and W8A8_64 (same int8 weights, other activations)."""
    if {W4A8.name, GGUF.name} & {mode, model.quant}:
        raise ValueError(f"a {model.quant} model cannot become {mode}: {W4A8.name} holds other weights (4-bit) than "
                         f"the int8 modes, {GGUF.name} a file's own blocks; load the float32 weights again with "
                         f"quant={mode!r}")
    check_blocks(model, mode)
    layers = [dataclasses.replace(w, **{f: dataclasses.replace(getattr(w, f), mode=mode) for f in MATRICES})
              for w in model.layers]
    return dataclasses.replace(model, layers=layers, lm_head_q=dataclasses.replace(model.lm_head_q, mode=mode),
                               quant=mode, fast=None)


# the matrices the fast path fuses into one (kernels/forward.py), each stacked over the layers for the decode step
FUSED_ROLES = (("wq", "wk", "wv"), ("wo",), ("w_gate", "w_up"), ("w_down",))


def role_tile(mats: list) -> type | None:
    """The tile a fused role (FUSED_ROLES; its matrices of every layer) runs on in the gguf mode, as the block class
    whose layout it reads: the narrowest that holds every part's q, without m where every part's m is the same
    multiple of d. Q6Linear if every part is Q6_K; S4Linear / Q4Linear if every part is nibbles; S5Linear /
    Q5Linear if every part is nibbles or 5-bit values (a nibble is a 5-bit value; the minimum stored unless every
    part is Q5_0's: an S4Linear part carries -8 d); S8Linear if every part is bytes with m = -128 d or Q6_K (a Q6_K
    part beside other formats is requantized by Q8_0's rule: Q6Linear.on_bytes), else B8Linear (a nibble or a 5-bit
    value is a byte); None for the int8 modes' matrices."""
    if not isinstance(mats[0], (BlockLinear, Q6Linear)):
        return None
    every = lambda kind: all(isinstance(q, kind) for q in mats)       # noqa: E731
    if every(Q6Linear):
        return Q6Linear
    if every(Q4Linear):
        return S4Linear if every(S4Linear) else Q4Linear
    if all(isinstance(q, (Q4Linear, Q5Linear)) for q in mats):
        return S5Linear if every(S5Linear) else Q5Linear
    return S8Linear if all(isinstance(q, (S8Linear, Q6Linear)) for q in mats) else B8Linear


def tile_nbytes(q, tile: type | None) -> int:
    """The bytes a matrix takes on a role's tile (role_tile): its own, or what that tile's layout holds."""
    if tile is None or tile is Q6Linear:
        return q.nbytes
    D, O = q.shape
    per_32 = {B8Linear: 32 + 4, S8Linear: 32 + 2, Q5Linear: 20 + 4, S5Linear: 20 + 2, Q4Linear: 16 + 4,
              S4Linear: 16 + 2}[tile]                                     # q, then d (and m) as float16
    return D // Q4_GROUP * O * per_32


def bytes_per_decode_step(model: Model) -> int:
    """Weight bytes one decode step reads: every matmul weight once (the LM head included), norms aside, as the tile
    of its fused role holds it (role_tile): LLaMA's block packs a role's matrices of every layer alike (stacked for
    kernels/forward.py's decode step), another family's block each layer's on its own (kernels/block_forward.py)."""
    groups = [[w] for w in model.layers] if model.config.block_switches() else [model.layers]
    total = 0
    for role in FUSED_ROLES:
        for layers in groups:
            mats = [getattr(w, f) for w in layers for f in role]
            kind = role_tile(mats)
            total += sum(tile_nbytes(q, kind) for q in mats)
    return total + (model.lm_head_q.nbytes if model.lm_head_q is not None else model.head.nbytes)


# --- SmoothQuant (lesson 7, "outliers"): move the activations' outliers into the weights -------------------------
#
# (Xiao et al., 2023) y = x @ W = (x / s) @ (s[:, None] * W) for any positive s per input channel j. Choosing
#     s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)
# (max over calibration tokens for X, over the matrix's outputs for W) evens out the two ranges: after it, channel j
# of the activations spans max|X_j|^(1-alpha) max|W_j|^(1-alpha) and of the weights max|X_j|^alpha max|W_j|^alpha.
# The division by s costs nothing at run time: it folds into the weight of the RMSNorm in front (for Q|K|V and for
# gate|up, which share their input, one s for the matrices together), and for W_down's input silu(gate) * up into
# the columns of W_up; W_o's input, the attention output, into the columns of W_v (one s per KV head's channel,
# shared by the query heads of its group). Per-output-channel int8 weights do not mind a column scaled.

SMOOTH_ALPHA = 0.5
CALIBRATION_TEXT = Path(__file__).parent / "data" / "calibration.txt"


def smoothing_factors(x_amax: np.ndarray, w_amax: np.ndarray, alpha: float = SMOOTH_ALPHA) -> np.ndarray:
    """[D] per-channel max |activation| and [D] max |weight| over a row of W -> s [D] float32 (1 where either is 0)."""
    ok = (x_amax > 0) & (w_amax > 0)
    s = np.ones(x_amax.shape, np.float64)
    s[ok] = x_amax[ok].astype(np.float64) ** alpha / w_amax[ok].astype(np.float64) ** (1 - alpha)
    return s.astype(np.float32)


def calibration_ids(tokenizer) -> list[list[int]]:
    """The shipped calibration passages (public domain; not the evaluation text) as token ids, the last one as a
    chat turn (the instruct model's usual input, with its special tokens)."""
    text = CALIBRATION_TEXT.read_text().split("\n", 1)[1]
    parts = [p.strip() for p in text.split("\n---\n")]
    return [tokenizer.encode(p) for p in parts[:-1]] + [tokenizer.encode_chat([{"role": "user", "content": parts[-1]}])]


@dataclass(slots=True)
class _Recorder:
    """Stands where a weight matrix stood in model.forward: records max |x| per input channel, then multiplies."""
    w: np.ndarray
    amax: np.ndarray
    __array_ufunc__ = None

    @property
    def shape(self):
        return self.w.shape

    def __rmatmul__(self, x):
        np.maximum(self.amax, np.abs(x).max(axis=0), out=self.amax)
        return x @ self.w


def activation_maxima(model: Model, sequences: list[list[int]]) -> list[dict[str, np.ndarray]]:
    """Per layer: max |x_j| over every calibration token of the input of wq (= wk, wv), wo, w_gate (= w_up) and
    w_down, from float32 forwards of `sequences` over their whole prefix (as naive.forward runs them)."""
    recs = [{f: _Recorder(getattr(w, f), np.zeros(getattr(w, f).shape[0], np.float32))
             for f in ("wq", "wo", "w_gate", "w_down")} for w in model.layers]
    probe = dataclasses.replace(model, layers=[dataclasses.replace(w, **r) for w, r in zip(model.layers, recs)],
                                quant=NONE.name, backend="numpy", fast=None)
    for ids in sequences:
        model_forward(probe, np.asarray(ids, np.int64), np.arange(len(ids)),
                      lambda layer, q, k, v: causal_attention(q, k, v))
    return [{f: r.amax for f, r in layer.items()} for layer in recs]


def smooth_model(model: Model, maxima: list[dict[str, np.ndarray]], alpha: float = SMOOTH_ALPHA) -> Model:
    """The float32 model with SmoothQuant's factors folded in (see above): the same function up to float rounding,
    with activations that quantise better. Quantise the result as usual (quantize_model)."""
    if model.quant != NONE.name:
        raise ValueError("smooth_model takes the float32 model (smooth first, then quantise)")
    cfg = model.config
    N, K, H = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    rows_max = lambda *ws: np.abs(np.concatenate(ws, axis=1)).max(axis=1)               # noqa: E731  [D_in]
    layers = []
    for w, m in zip(model.layers, maxima):
        s = smoothing_factors(m["wq"], rows_max(w.wq, w.wk, w.wv), alpha)               # Q|K|V: attn_norm
        attn_norm, wq, wk, wv = w.attn_norm / s, w.wq * s[:, None], w.wk * s[:, None], w.wv * s[:, None]
        s = smoothing_factors(m["w_gate"], rows_max(w.w_gate, w.w_up), alpha)          # gate|up: mlp_norm
        mlp_norm, w_gate, w_up = w.mlp_norm / s, w.w_gate * s[:, None], w.w_up * s[:, None]
        s = smoothing_factors(m["w_down"], rows_max(w.w_down), alpha)                  # down: W_up's columns
        w_up, w_down = w_up / s, w.w_down * s[:, None]
        # W_o's input channel (query head n, dim d) comes from V's (KV head n // g, d): one s per KV channel
        x_kv = m["wo"].reshape(K, N // K, H).max(axis=1)                                # [K, H]
        w_kv = np.abs(w.wo).max(axis=1).reshape(K, N // K, H).max(axis=1)
        s_kv = smoothing_factors(x_kv.ravel(), w_kv.ravel(), alpha)                     # [K H]
        s_o = np.repeat(s_kv.reshape(K, 1, H), N // K, axis=1).ravel()                  # [N H]
        wv, wo = wv / s_kv, w.wo * s_o[:, None]
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)                       # noqa: E731
        layers.append(LayerWeights(f32(attn_norm), f32(wq), f32(wk), f32(wv), f32(wo), f32(mlp_norm), f32(w_gate),
                                   f32(w_up), f32(w_down)))
    return dataclasses.replace(model, layers=layers)


# --- the on-disk cache -------------------------------------------------------------------------------------------

def _cache_key(weights_dir: Path) -> dict:
    st = (weights_dir / "model.safetensors").stat()
    return {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns, "scheme": "per-output-channel-int8-v2"}


def load_or_quantize(model: Model, weights_dir: str | Path | None, mode: str) -> Model:
    """quantize_model, reading the int8 tensors from `<weights_dir>/model.int8.safetensors` when they were made
    from this very model.safetensors (size + mtime), writing them there otherwise (if the folder is writable)."""
    if get_mode(mode) is NONE:
        return model
    check_blocks(model, mode)
    if weights_dir is None or get_mode(mode) in (W4A8, GGUF):   # (their blocks come from the float32 weights or
        #                                                              the file: nothing to cache)
        return quantize_model(model, mode)
    from safetensors.numpy import load_file, save_file
    d = Path(weights_dir)
    path, meta_path = d / "model.int8.safetensors", d / "model.int8.json"
    key = _cache_key(d)
    try:
        if json.loads(meta_path.read_text()) == key:
            t = load_file(str(path))
            q = lambda name: QuantizedLinear(t[name + ".wq"], t[name + ".scale"], mode)   # noqa: E731
            layers = [dataclasses.replace(w, **{f: q(f"layers.{i}.{f}") for f in MATRICES})
                      for i, w in enumerate(model.layers)]
            return with_mlp_planes(dataclasses.replace(model, layers=layers, lm_head_q=q("lm_head"), quant=mode,
                                                       fast=None))
    except (OSError, ValueError, KeyError):
        pass                                   # missing, stale or corrupt: quantise again below
    qm = quantize_model(model, mode)
    tensors = {"lm_head.wq": qm.lm_head_q.wq, "lm_head.scale": qm.lm_head_q.scale}
    for i, w in enumerate(qm.layers):
        for f in MATRICES:
            tensors[f"layers.{i}.{f}.wq"] = getattr(w, f).wq
            tensors[f"layers.{i}.{f}.scale"] = getattr(w, f).scale
    try:
        tmp = path.with_suffix(".tmp")
        save_file(tensors, str(tmp))
        tmp.replace(path)
        meta_path.write_text(json.dumps(key))
    except OSError:
        pass                                   # a read-only folder: quantising at each start is slower, still correct
    return qm


def is_q4_1(model: Model) -> bool:
    """Are every layer matrix's weights Q4_1 blocks already (quantize_q4_1 gives them back exactly)? SmolLM2's are
    (weights.py: the GGUF's layers are Q4_1); a random or a float16 model's are not."""
    return all(np.array_equal(quantize_q4_1(getattr(w, f)).dequantize(), getattr(w, f))
               for w in model.layers for f in MATRICES)
