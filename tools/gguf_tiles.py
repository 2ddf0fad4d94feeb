"""Which tile runs each matrix of a GGUF file in quant="gguf", what a decode step reads, and how close the fast path
stays to the float32 path (teacher-forced top-1 on the reference prompts, perplexity on the shipped text: the
measurements and bounds of tests/test_quant_accuracy.py). docs/your-own-model.md's format table comes from here.

    PYTHONPATH=. .venv/bin/python tools/gguf_tiles.py /work/gguf/SmolLM2-135M-Instruct.Q4_K_M.gguf [...]
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np                                                       # noqa: E402

from tinyserve import backend, naive, quant, weights                    # noqa: E402
from tinyserve.gguf_file import LAYER_TENSORS                           # noqa: E402
from tinyserve.kernels import isa                                       # noqa: E402
from tests.quant_accuracy import PPL_WINDOW, agreement, fp32_logits, perplexity_ids   # noqa: E402

ROLES = {"q|k|v": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate|up": ("ffn_gate", "ffn_up"),
         "down": ("ffn_down",)}


def tiles(model) -> dict[str, str]:
    """role -> "its formats -> the packed kind" (a stacked role runs one kind on every layer)."""
    fw = backend.prepare(model).fast
    kinds = {"q|k|v": fw.decode.layers.qkv, "o": fw.decode.layers.o, "gate|up": fw.decode.layers.gate_up,
             "down": fw.decode.layers.down}
    t = model.gguf_tensors
    out = {}
    for role, parts in ROLES.items():
        fmts = Counter(t[f"blk.{i}.{p}.weight"].type_name for i in range(model.config.n_layers) for p in parts)
        out[role] = f"{'/'.join(sorted(fmts))} -> {type(kinds[role]).__name__.removesuffix('Weights')}"
    head = t["token_embd.weight" if model.output is None else "output.weight"].type_name
    out["head"] = f"{head} -> {type(fw.lm_head).__name__.removesuffix('Weights')}"
    return out


def step_bytes(model) -> tuple[int, int]:
    """(the packed weights a fused decode step reads, the file's own bytes of the same matrices: llama.cpp's)."""
    fw = model.fast
    packed = sum(a.nbytes for m in (fw.decode.layers.qkv, fw.decode.layers.o, fw.decode.layers.gate_up,
                                    fw.decode.layers.down, fw.lm_head) for a in m)
    names = {f"blk.{i}.{n}" for i in range(model.config.n_layers) for n, f in LAYER_TENSORS.items()
             if f in quant.MATRICES}
    names.add("token_embd.weight" if model.output is None else "output.weight")
    return packed, sum(model.gguf_tensors[n].raw.nbytes for n in names)


def running_text(model, ids: list[int]) -> tuple[np.ndarray, float]:
    """The logits [2044, V] of the shipped text's next tokens (4 windows of 512, as quant_accuracy.perplexity) and
    the perplexity they give."""
    out, nll = [], 0.0
    for s in range(0, len(ids), PPL_WINDOW):
        chunk = ids[s:s + PPL_WINDOW]
        logits = naive.forward(model, chunk)[:-1].astype(np.float64)                 # [W-1, V]
        m = logits.max(-1, keepdims=True)
        nll += float((m[:, 0] + np.log(np.exp(logits - m).sum(-1)) - logits[np.arange(len(chunk) - 1),
                                                                              chunk[1:]]).sum())
        out.append(logits.argmax(-1))
    top = np.concatenate(out)
    return top, float(np.exp(nll / len(top)))


def main(paths: list[str]) -> None:
    from tinyserve.tokenizer import load_tokenizer
    tok = load_tokenizer(weights.DEFAULT_WEIGHTS_DIR)
    ids = perplexity_ids(tok)
    print(f"kernels: {isa.NAME}")
    for p in paths:
        m = weights.load_model(p)
        ref, (top32, ppl32) = fp32_logits(m), running_text(m, ids)
        fast = backend.set_backend(m, quant.GGUF.name, "numba")
        a, (top, ppl) = agreement(fast, ref), running_text(fast, ids)
        packed, file_bytes = step_bytes(fast)
        print(f"{Path(p).name}: {tiles(fast)} | step {packed / 1e6:.1f} MB (file {file_bytes / 1e6:.1f} MB) | "
              f"top-1 {a.top1:.1%} of {a.positions} (widest flip {a.max_flip_margin:.2f}) | "
              f"ppl {ppl:.4f} / {ppl32:.4f} = {ppl / ppl32:.4f} | top-1 on the text {np.mean(top == top32):.1%} "
              f"of {len(top)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
