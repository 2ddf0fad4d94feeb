"""Lesson 7: int8 weights (and activations) — the NumPy reference of the fast path.

A decode step at batch 1 reads every weight once and does two FLOPs with it: its speed is the memory bandwidth
divided by the bytes of the weights. int8 instead of float32 reads 4x fewer bytes. Symmetric, per output channel:

    W[:, o] ~ wq[:, o] * scale[o]        scale[o] = max_i |W[i, o]| / 127,  wq = round(W / scale) in [-127, 127]

Two modes (`quantize_model(model, mode)`):
- "int8" (W8A32, weight-only): y = (x @ wq) * scale, activations stay float32.
- "w8a8": the activations are quantised too, one scale per row (token), at run time ("dynamic"):
      x[t, :] ~ xq[t, :] * sx[t],  sx[t] = max_i |x[t, i]| / 127
      y[t, o] = float32(sum_i xq[t, i] * wq[i, o]) * sx[t] * scale[o]
  the sum is an exact integer (int32; at most D * 127 * 127 = 25 M for D = 1536, far below 2^31), so the
  kernels (kernels/matmul.py) reproduce this reference bit for bit.
Why per output channel and not per group of 32/64 inputs: one scale per dot product keeps the whole sum in
integers, and on SmolLM2 it costs little accuracy (lesson 7 measures both).

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

import numpy as np

from .model import LayerWeights, Model

QUANT_MODES = ("none", "int8", "w8a8")
MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")   # the LayerWeights fields that are matmuls


@dataclass(slots=True)
class QuantizedLinear:
    """A [D_in, O] weight matrix as int8 + one float32 scale per output channel; `x @ self` multiplies."""
    wq: np.ndarray       # [D_in, O] int8
    scale: np.ndarray    # [O] float32
    mode: str            # "int8" (W8A32) or "w8a8"

    __array_ufunc__ = None   # tells NumPy not to treat us as an array: `x @ q` then calls q.__rmatmul__(x)

    @property
    def shape(self) -> tuple[int, int]:
        return self.wq.shape

    @property
    def nbytes(self) -> int:
        return self.wq.nbytes + self.scale.nbytes

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:  # [T, D_in] float32 -> [T, O] float32
        return matmul_reference(x, self)

    def dequantize(self) -> np.ndarray:  # -> [D_in, O] float32
        return self.wq.astype(np.float32) * self.scale


def quantize_weight(w: np.ndarray, mode: str = "int8") -> QuantizedLinear:
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


def matmul_reference(x: np.ndarray, q: QuantizedLinear) -> np.ndarray:
    """x [T, D_in] float32 @ q -> [T, O] float32, the readable definition the kernels are tested against."""
    if q.mode == "int8":
        return (x @ q.wq.astype(np.float32)) * q.scale
    xq, sx = quantize_rows(x)
    # float64 BLAS is exact here: every partial sum is an integer below 2^53, so this IS the int32 result
    acc = (xq.astype(np.float64) @ q.wq.astype(np.float64)).astype(np.int32)        # [T, O]
    return acc.astype(np.float32) * sx[:, None] * q.scale


def quantize_model(model: Model, mode: str) -> Model:
    """The same model with every matmul weight quantised (attention, MLP and the tied LM head); the embedding
    lookup table and the norms stay float32 (a lookup reads T rows, not the whole table)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {mode!r}")
    if mode == "none":
        return model
    layers = [dataclasses.replace(w, **{f: quantize_weight(getattr(w, f), mode) for f in MATRICES})
              for w in model.layers]
    return dataclasses.replace(model, layers=layers, lm_head_q=quantize_weight(model.embed.T, mode), quant=mode,
                               fast=None)


def with_mode(model: Model, mode: str) -> Model:
    """A quantised model switched between "int8" and "w8a8" (same int8 weights, other activation handling)."""
    layers = [dataclasses.replace(w, **{f: dataclasses.replace(getattr(w, f), mode=mode) for f in MATRICES})
              for w in model.layers]
    return dataclasses.replace(model, layers=layers, lm_head_q=dataclasses.replace(model.lm_head_q, mode=mode),
                               quant=mode, fast=None)


def bytes_per_decode_step(model: Model) -> int:
    """Weight bytes one decode step reads: every matmul weight once (the LM head included), norms aside."""
    total = sum(getattr(w, f).nbytes for w in model.layers for f in MATRICES)
    return total + (model.lm_head_q.nbytes if model.lm_head_q is not None else model.embed.nbytes)


# --- the on-disk cache -------------------------------------------------------------------------------------------

def _cache_key(weights_dir: Path) -> dict:
    st = (weights_dir / "model.safetensors").stat()
    return {"source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns, "scheme": "per-output-channel-int8-v2"}


def load_or_quantize(model: Model, weights_dir: str | Path | None, mode: str) -> Model:
    """quantize_model, reading the int8 tensors from `<weights_dir>/model.int8.safetensors` when they were made
    from this very model.safetensors (size + mtime), writing them there otherwise (if the folder is writable)."""
    if mode == "none":
        return model
    if weights_dir is None:
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
            return dataclasses.replace(model, layers=layers, lm_head_q=q("lm_head"), quant=mode, fast=None)
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
        pass                                   # a read-only folder: quantising each start is ~2 s, still correct
    return qm


BACKENDS = ("numpy", "numba")


def set_backend(model: Model, quant: str = "none", backend: str = "numpy", weights_dir=None) -> Model:
    """The one place the backend is chosen: quantise (or load the cached int8 tensors) and pick the kernels.
    Every strategy (kv_cache, Engine, speculative) calls model.forward and so runs what is chosen here."""
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES}, got {quant!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if model.quant != "none" and quant != model.quant:
        model = with_mode(model, quant) if quant != "none" else model
        if quant == "none":
            raise ValueError("this model is already quantised; load the float32 weights again for quant='none'")
    elif quant != "none":
        model = load_or_quantize(model, weights_dir, quant)
    return dataclasses.replace(model, backend=backend)
