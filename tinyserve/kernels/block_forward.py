"""The fast path of a block that is not LLaMA's (lesson 11): model.forward itself, its matrices the kernels' tiles.

kernels/forward.py fuses LLaMA's block into three Numba calls per layer; every switch of another family (Gemma 3's
norms after attention and MLP, its Q/K norms, GELU, scaled embedding and sliding windows; Qwen2's biases) would need
those fused kernels written again. This module keeps the reference forward, switches and all, and swaps each
quantised matrix for a `TileMatrix`: the same [D_in, O] weights packed for kernels/matmul.py, whose `x @ W` runs the
kernels' tile for its kind. What stays NumPy are the row-wise steps (norms, RoPE, the activation, the residual adds:
a few reads of [T, D] each); the matmuls, which read every weight, and attention (the strategy's: on the numba
backend the paged Numba kernel, masked by window) run on the kernels.

What it does differently from the NumPy reference of the same quantised model (quant.matmul_reference): nothing
in the int8-activation kinds. The tile quantises a row as quant.quantize_blocks does and adds its blocks' exact
integer dot products in the same order, so with the same attention the logits are the same bits
(tests/test_block_forward.py). Every step is per row, so a row's logits depend on what shares its step only
through attention, whose kernels add in one order (kernels/key_chunks.py): batch invariance holds as on LLaMA.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
from numba import njit

from ..model import forward as reference_forward
from ..quant import MATRICES
from .forward import _pack
from .matmul import BLOCK, W8A32Weights, matmul_items, matmul_w8a32, quantize_rows


@njit(cache=True, parallel=True)
def _int8_matmul(wt, xu, sx, out):
    """out [T, O] = xu [T, D] (uint8 + 128, scales sx [T, nb]) @ wt: the tile of wt's kind (matmul._kind)."""
    matmul_items(wt, xu, sx, out, False)


@dataclass(slots=True)
class TileMatrix:
    """A [D_in, O] matrix packed for the kernels (a kind of kernels/matmul.py: W8A8Weights, W4A8Weights,
    W8A32Weights, or a kind added there later): `x @ m` multiplies on its tile. Dispatch is on the packed kind
    only, so a new kind with int8 activations runs here unchanged."""
    w: tuple                 # the packed kind (a NamedTuple of arrays)
    shape: tuple[int, int]   # (D_in, O)

    __array_ufunc__ = None   # NumPy must not treat us as an array: `x @ m` then calls m.__rmatmul__(x)

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:    # [T, D_in] float32 -> [T, O] float32
        x = np.ascontiguousarray(x, np.float32)
        T, O = x.shape[0], self.w.w.shape[0] * BLOCK
        if T == 0:                                         # (a prefill chunk that samples no row: no logits)
            return np.zeros((0, self.shape[1]), np.float32)
        if isinstance(self.w, W8A32Weights):               # float32 activations: nothing to quantise
            out = matmul_w8a32(x, self.w.w, self.w.scale)
        else:                                              # int8 activations, blocks.shape[0] scales a row
            xu, sx = np.empty(x.shape, np.uint8), np.empty((T, self.w.blocks.shape[0]), np.float32)
            quantize_rows(x, xu, sx)
            out = np.empty((T, O), np.float32)
            _int8_matmul(self.w, xu, sx, out)
        return out if O == self.shape[1] else out[:, :self.shape[1]]


def tile(mode: str, q) -> TileMatrix:
    """One quantised matrix (quant.QuantizedLinear or Q4Linear) -> its TileMatrix (kernels/forward.py's packing)."""
    return TileMatrix(_pack(mode, q), tuple(q.shape))


def prepare(model):
    """The model whose layer matrices and LM head are TileMatrix (packed once); the rest (embedding, norms, RoPE
    tables, the switches' extra weights) is the model's own arrays, not copied."""
    layers = [dataclasses.replace(w, **{f: tile(model.quant, getattr(w, f)) for f in MATRICES}) for w in model.layers]
    return dataclasses.replace(model, layers=layers, lm_head_q=tile(model.quant, model.lm_head_q), backend="numpy",
                               fast=None)


def block_forward(model, tokens: np.ndarray, positions: np.ndarray, attention, logit_rows=None) -> np.ndarray:
    """model.forward's contract (logits [len(logit_rows) or T, V] float32) for a quantised model whose block the
    fused kernels lack: the reference forward over the packed matrices (model.fast, packed on first use)."""
    if model.fast is None:
        model.fast = prepare(model)
    return reference_forward(model.fast, tokens, positions, attention, logit_rows)
