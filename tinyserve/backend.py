"""Which forward runs for a model (lesson 7): the readable NumPy reference or the fused Numba kernels.

model.forward is the reference and knows nothing of the fast path; kernels/forward.py computes the same steps with
the Numba kernels. A Model records how it was loaded (quant.set_backend: its quantisation mode and its backend),
and this module reads that in one place: `runs_on_kernels` answers "does this model run on the kernels?", `forward`
runs the one chosen, and `prepare` packs the weights the kernels need. Every strategy (naive, kv_cache, the Engine)
calls `forward` with the same arguments, so each runs on whichever path the model was given.
"""
from __future__ import annotations

import numpy as np

from .attention_backends import KVLayout
from .model import AttentionFn, Model, forward as reference_forward
from .quant import get_mode


def kernel_gaps(model: Model) -> list[str]:
    """What this model's block needs that the kernels do not implement (they run LLaMA's block): [] if nothing.
    weights.load_model runs such a model on the NumPy forward rather than let the kernels skip a step."""
    cfg = model.config
    return [what for what, needed in (
        ("Q/K/V biases", cfg.qkv_bias), ("Q/K norms", cfg.qk_norm), ("norms after attention and MLP", cfg.post_norms),
        (f"the {cfg.activation} MLP", cfg.activation != "silu"), ("a scaled embedding", cfg.embed_scale != 1.0),
        ("sliding windows", cfg.sliding_window > 0), ("an attention scale of its own", cfg.attn_scale is not None),
        ("a per-layer RoPE base", cfg.rope_theta_local is not None)) if needed]


def runs_on_kernels(model: Model) -> bool:
    """Does this model's forward run on the Numba kernels? (A float32 model on the numba backend does not: only
    its paged attention is Numba's; the kernels multiply quantised weights. Nor does a block they lack: kernel_gaps.)"""
    return model.backend == "numba" and get_mode(model.quant).kernels is not None and not kernel_gaps(model)


def prepare(model: Model) -> Model:
    """Pack the weights for the kernels once (model.fast; ~1 s for SmolLM2), before anything is timed."""
    if runs_on_kernels(model) and model.fast is None:
        from .kernels.forward import prepare as pack
        model.fast = pack(model)
    return model


def forward(model: Model, tokens: np.ndarray, positions: np.ndarray, attention: AttentionFn,
            logit_rows: np.ndarray | None = None, kv_layout: KVLayout | None = None) -> np.ndarray:
    """model.forward's contract (logits [len(logit_rows) or T, V] float32), on the model's path.

    `kv_layout`: where the step's K/V live, given only with the strategy's default attention; it lets the kernels
    run a decode step of up to 16 rows as one call that writes the K/V itself instead of calling `attention`
    (kernels/decode_step.py). The reference has no use for it."""
    if runs_on_kernels(model):
        from .kernels.forward import fast_forward
        return fast_forward(model, tokens, positions, attention, logit_rows, kv_layout)
    return reference_forward(model, tokens, positions, attention, logit_rows)
