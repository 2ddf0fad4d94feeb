"""Accuracy of a quantised model against float32: the measurements tests/test_quant_accuracy.py pins and lesson 7's
table shows (the notebook imports this file, so both report the same numbers the same way).

Also the per-group-of-64 quantiser that lesson 7 compares with tinyserve's per-output-channel one. It is a
"fake-quant" here (weights rounded to int8 per group and stored dequantised as float32): the rounding is exactly
that of an int8 kernel with one scale per group; only the float order of the sums differs (~1e-6 relative), far
below the quantisation error it measures.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyserve import naive
from tinyserve.model import Model
from tinyserve.quant import MATRICES, quantize_rows

FIXTURES = Path(__file__).parent / "fixtures"
TEXT_PATH = FIXTURES / "perplexity_text.txt"
PPL_WINDOW = 512          # tokens per forward: perplexity over non-overlapping windows of the shipped text
PPL_TOKENS = 2048         # the first 2048 tokens of the text (4 windows): enough to separate the schemes, fast


def reference_prompts() -> dict[str, list[int]]:
    """The reference-fixture prompts (tests/fixtures/reference.json): name -> token ids."""
    ref = json.loads((FIXTURES / "reference.json").read_text())
    return {name: p["ids"] for name, p in ref["prompts"].items()}


def perplexity_ids(tok) -> list[int]:
    """The shipped public-domain text (its first line is a header that says what it is), as PPL_TOKENS ids."""
    text = TEXT_PATH.read_text().split("\n", 1)[1]
    ids = tok.encode(text)
    assert len(ids) >= PPL_TOKENS, f"{TEXT_PATH.name} has only {len(ids)} tokens"
    return ids[:PPL_TOKENS]


# --- per-group quantisation (the alternative lesson 7 measures) -------------------------------------------------

def quantize_per_group(w: np.ndarray, group: int = 64) -> np.ndarray:
    """[D_in, O] float32 -> [D_in, O] float32: each run of `group` inputs of each output column rounded to int8
    with its own scale (max |w| / 127 of that run), then multiplied back (so: one scale per group x column)."""
    D, O = w.shape
    if D % group:
        raise ValueError(f"D_in = {D} is not a multiple of the group size {group}")
    g = w.reshape(D // group, group, O)                                         # [D/g, g, O]
    amax = np.abs(g).max(axis=1, keepdims=True)                                 # [D/g, 1, O]
    s = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
    return (np.clip(np.rint(g / s), -127, 127) * s).reshape(D, O).astype(np.float32)


@dataclass(slots=True)
class FakeQuantLinear:
    """Stands where a weight matrix stood in model.forward (like quant.QuantizedLinear): `x @ self`."""
    w: np.ndarray           # [D_in, O] float32, already rounded (quantize_per_group)
    quantize_input: bool    # W8A8: round the activations per row (quant.quantize_rows) before the product

    __array_ufunc__ = None  # so that `x @ self` calls __rmatmul__

    @property
    def shape(self) -> tuple[int, int]:
        return self.w.shape

    def __rmatmul__(self, x: np.ndarray) -> np.ndarray:   # [T, D_in] -> [T, O]
        if self.quantize_input:
            xq, sx = quantize_rows(x)
            x = xq.astype(np.float32) * sx[:, None]
        return x @ self.w


def per_group_model(model: Model, mode: str, group: int = 64) -> Model:
    """The float32 model with every matmul weight (LM head included) quantised per group of `group` inputs."""
    fq = lambda w: FakeQuantLinear(quantize_per_group(w, group), mode == "w8a8")   # noqa: E731
    layers = [dataclasses.replace(w, **{f: fq(getattr(w, f)) for f in MATRICES}) for w in model.layers]
    return dataclasses.replace(model, layers=layers, lm_head_q=fq(model.embed.T))


# --- the measurements --------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Agreement:
    positions: int          # teacher-forced positions over all reference prompts
    top1: float             # fraction of positions whose argmax equals float32's
    max_logit_err: float    # max |logit - float32 logit| over every position and vocabulary entry
    max_flip_margin: float  # the largest float32 top-1/top-2 margin among the positions where top-1 changed (0 if
                            # none): flips at near-ties are rounding; a flip at a wide margin would be a bug


def fp32_logits(model: Model) -> dict[str, np.ndarray]:
    return {name: naive.forward(model, ids) for name, ids in reference_prompts().items()}   # name -> [T, V]


def agreement(model: Model, ref: dict[str, np.ndarray]) -> Agreement:
    """Teacher-forced: every position of every reference prompt sees the true prefix, not its own tokens."""
    n = same = 0
    err, flip_margin = 0.0, 0.0
    for name, ids in reference_prompts().items():
        q, r = naive.forward(model, ids), ref[name]                             # [T, V] each
        agree = q.argmax(-1) == r.argmax(-1)
        n, same = n + len(agree), same + int(agree.sum())
        err = max(err, float(np.abs(q - r).max()))
        if not agree.all():
            top2 = np.sort(r[~agree], axis=-1)[:, -2:]                          # [flips, 2]
            flip_margin = max(flip_margin, float((top2[:, 1] - top2[:, 0]).max()))
    return Agreement(n, same / n, err, flip_margin)


def perplexity(model: Model, ids: list[int], window: int = PPL_WINDOW) -> float:
    """exp(mean negative log-likelihood of each next token), over non-overlapping windows of `window` tokens
    (each window starts a fresh context, so the first token of a window is not predicted)."""
    nll, count = 0.0, 0
    for s in range(0, len(ids), window):
        chunk = ids[s:s + window]
        logits = naive.forward(model, chunk)[:-1].astype(np.float64)            # [W-1, V]
        m = logits.max(-1, keepdims=True)
        logz = (m[:, 0] + np.log(np.exp(logits - m).sum(-1)))                  # [W-1]
        nll += float((logz - logits[np.arange(len(chunk) - 1), chunk[1:]]).sum())
        count += len(chunk) - 1
    return float(np.exp(nll / count))
