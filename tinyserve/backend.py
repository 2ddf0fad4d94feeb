"""Which path runs (lesson 7): the quantisation mode, the backend and the kernels' variant, decided here and only here.

model.forward is the reference and knows nothing of the fast path; kernels/forward.py computes the same steps with
the Numba kernels; quant.py defines the formats in NumPy. This module joins them, and it is the one module outside
kernels/ that imports kernels/ (tests/test_structure.py checks it):

- `set_backend` loads a model for a path: quantise it (or read the cached int8 tensors) and record its backend;
  `--quant auto` resolves through `default_quant`, which asks the kernels' variant (kernels/isa.py) what is fastest.
- `runs_on_kernels` answers "does this model run on the kernels?", `forward` runs the one chosen, and `prepare`
  packs the weights the kernels need. Every strategy (naive, kv_cache, the Engine) calls `forward` with the same
  arguments, so each runs on whichever path the model was given.
- `step_threads` holds NumPy's BLAS to one thread around a step on the Numba path (one thread pool per step), and
  `dense_attention`, `kernel_variant`, `describe_kernels` hand the rest of kernels/ to the strategies and commands.
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np

from .attention_backends import KVLayout
from .model import AttentionFn, Model, forward as reference_forward
from .quant import (AUTO, GGUF, INT8, NONE, QUANT_MODES, W4A8, W8A8_64, check_blocks, get_mode, is_q4_1,
                    load_or_quantize, with_mode)

BACKENDS = ("numpy", "numba")

# The variants where quant="auto" picks w4a8 for Q4_1 weights: there it decodes faster than w8a8-64 at batch 1 (the
# step that streams every weight: 5 bits a weight against 8) and level at batch 16. With VNNI's one instruction per
# 64 byte multiply-adds, W4A8's float epilogue per 32 inputs weighs more than the bytes it saves once the tile is
# compute-bound, so it prefills slower there; decode is what a chat waits for, so auto takes W4A8 and
# `--quant w8a8-64` remains for prefill. A variant joins the list when a measurement puts it there
# (docs/performance.md, "The quantisation modes, measured").
W4A8_DEFAULT_ON = ("avx512vnni", "avxvnni", "avx2")


def kernel_variant() -> str:
    """The instruction set the kernels are built for (kernels/isa.py: the CPU's best, or TINYSERVE_KERNELS)."""
    from .kernels import isa
    return isa.NAME


def describe_kernels() -> str:
    """One line for the reports: the kernels' variant and how it multiplies bytes."""
    from .kernels import isa
    return isa.describe()


def default_quant(model: Model | None = None, backend: str = "numba") -> str:
    """quant="auto" (the CLI's default): the fastest mode whose accuracy stays within int8's bounds (top-1 >= 95 %,
    perplexity <= 1.02x float32: tests/test_quant_accuracy.py pins them for int8, w8a8-64 and w4a8; per-token w8a8
    misses them). On the numba backend:
    - gguf for a model loaded from a GGUF file (Model.gguf_tensors), on every variant: each matrix keeps the file's
      own blocks (quant.quantize_gguf), where requantizing its floats to int8 misses the bounds on K-quant files;
    - w4a8 for a model whose layers are Q4_1 already (quant.is_q4_1; SmolLM2, the model of the course, when model
      is None), on the variants of W4A8_DEFAULT_ON: it computes with the model's own weights and reads the fewest
      bytes a decode step;
    - else w8a8-64 wherever the kernels multiply bytes with a dot-product instruction (kernels/isa.py: vpdpbusd,
      vpmaddubsw + vpmaddwd, sdot), where it is faster than int8 at batch 1, 16 and prefill (lesson 7);
    - int8 on the `generic` kernels (plain loops, where W8A8 is slower than int8) or for a model whose matrices'
      inputs do not split into blocks of 64.
    On the numpy backend, float32: the NumPy int8 paths are readable references, slower than BLAS."""
    if backend != "numba":
        return NONE.name
    variant = kernel_variant()
    if model is not None and model.quant in (W4A8.name, GGUF.name):
        return model.quant
    if model is not None and model.quant == NONE.name and model.gguf_tensors is not None:
        try:
            check_blocks(model, GGUF.name)
            return GGUF.name
        except ValueError:
            pass
    if variant == "generic":
        return INT8.name
    q4 = variant in W4A8_DEFAULT_ON
    if model is None:
        return (W4A8 if q4 else W8A8_64).name
    try:
        check_blocks(model, W4A8.name)
        if q4 and model.quant == NONE.name and is_q4_1(model):
            return W4A8.name
        check_blocks(model, W8A8_64.name)
    except ValueError:
        return INT8.name
    return W8A8_64.name


def set_backend(model: Model, quant: str = NONE.name, backend: str = "numpy", weights_dir=None) -> Model:
    """The one place the path is chosen: quantise (or load the cached int8 tensors) and record the backend.
    Every strategy (kv_cache, Engine, speculative) calls `forward`, which runs what is chosen here.
    quant="auto" picks default_quant(model, backend)."""
    if quant == AUTO and backend in BACKENDS:
        quant = default_quant(model, backend)
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {QUANT_MODES} or {AUTO!r}, got {quant!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if model.quant != NONE.name and quant != model.quant:
        if quant == NONE.name:
            raise ValueError("this model is already quantised; load the float32 weights again for quant='none'")
        model = with_mode(model, quant)
    elif quant != NONE.name and model.quant == NONE.name:   # (quantised in this mode already: the backend changes)
        model = load_or_quantize(model, weights_dir, quant)
    return dataclasses.replace(model, backend=backend)


def block_switches(model: Model) -> list[str]:
    """The switches of this model's block that the fused LLaMA kernels (kernels/forward.py) do not implement: []
    for LLaMA's block (config.ModelConfig.block_switches). A model with any runs kernels/block_forward.py instead:
    model.forward with its matrices on the kernels' tiles and attention on the strategy's kernel (masked by window)."""
    return model.config.block_switches()


def kernel_gaps(model: Model) -> list[str]:
    """What this model's block needs that the fast path does not implement: [] if nothing (every family's switch
    runs there: block_switches). weights.load_model runs such a model on the NumPy forward rather than let the
    kernels skip a step. The attention kernels scale scores by 1/sqrt(H) only."""
    return ["an attention scale of its own"] if model.config.attn_scale is not None else []


def runs_on_kernels(model: Model) -> bool:
    """Does this model's forward run on the Numba kernels? (A float32 model on the numba backend does not: only
    its paged attention is Numba's; the kernels multiply quantised weights. Nor does a block they lack: kernel_gaps.)"""
    return model.backend == "numba" and get_mode(model.quant).kernels is not None and not kernel_gaps(model)


def prepare(model: Model) -> Model:
    """Pack the weights for the kernels once (model.fast), before anything is timed."""
    if runs_on_kernels(model) and model.fast is None:
        if block_switches(model):
            from .kernels.block_forward import prepare as pack
        else:
            from .kernels.forward import prepare as pack
        model.fast = pack(model)
    return model


def forward(model: Model, tokens: np.ndarray, positions: np.ndarray, attention: AttentionFn,
            logit_rows: np.ndarray | None = None, kv_layout: KVLayout | None = None) -> np.ndarray:
    """model.forward's contract (logits [len(logit_rows) or T, V] float32), on the model's path.

    `kv_layout`: where the step's K/V live, given only with the strategy's default attention; it lets the kernels
    run a decode step of up to 16 rows as one call that writes the K/V itself instead of calling `attention`
    (kernels/decode_step.py; another family's block: one region a layer, kernels/block_decode.py). The reference
    has no use for it."""
    if runs_on_kernels(model):
        if block_switches(model):                  # another family's block: the reference's steps, on the tiles
            from .kernels.block_forward import block_forward
            return block_forward(model, tokens, positions, attention, logit_rows, kv_layout)
        from .kernels.forward import fast_forward
        return fast_forward(model, tokens, positions, attention, logit_rows, kv_layout)
    return reference_forward(model, tokens, positions, attention, logit_rows)


def dense_attention(backend: str):
    """The contiguous-cache causal attention of the numba backend's kernels (kernels/dense_attention.py: the
    reference's result within rtol 1e-4), or None on the numpy backend (the strategy keeps its own)."""
    if backend != "numba":
        return None
    from .kernels.dense_attention import causal_attention
    return causal_attention


def dense_window_attention(backend: str):
    """The contiguous-cache attention of a sliding-window layer on the numba backend (kernels/dense_attention.py's
    window_attention, key_chunks' order), or None on the numpy backend (kv_cache's rectangular_attention)."""
    if backend != "numba":
        return None
    from .kernels.dense_attention import window_attention
    return window_attention


NUMBA_THREADS: int | None = None    # set by course.fit_threads: the Numba threads a step starts (None: Numba's own)


def step_threads(backend: str):
    """The context a step runs in: on the numba backend NumPy's BLAS is held at one thread (two thread pools on the
    same cores take turns evicting each other: kernels.single_thread_blas) and Numba starts NUMBA_THREADS (its
    count is per Python thread, and a server runs its steps on a thread of its own); on the numpy backend, nothing."""
    if backend != "numba":
        return contextlib.nullcontext()
    from .kernels import single_thread_blas
    if NUMBA_THREADS is not None:
        import numba
        if numba.get_num_threads() != NUMBA_THREADS:
            numba.set_num_threads(NUMBA_THREADS)
    return single_thread_blas()


def kernel_cache_dir() -> str:
    """Where Numba keeps the compiled kernels (kernels/__init__.py sets NUMBA_CACHE_DIR before numba reads it)."""
    from . import kernels
    return kernels.CACHE_DIR


def check_threading_layer() -> None:
    """After a step on the numba backend: warn (once) if Numba fell back to its slow thread pool."""
    from .kernels import check_threading_layer as check
    check()
