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

from tinyserve import backend, quant, weights                           # noqa: E402
from tinyserve.gguf_file import LAYER_TENSORS                           # noqa: E402
from tinyserve.kernels import isa                                       # noqa: E402
from tests.quant_accuracy import agreement, fp32_logits, perplexity, perplexity_ids   # noqa: E402

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


def main(paths: list[str]) -> None:
    from tinyserve.tokenizer import load_tokenizer
    tok = load_tokenizer(weights.DEFAULT_WEIGHTS_DIR)
    ids = perplexity_ids(tok)
    print(f"kernels: {isa.NAME}")
    for p in paths:
        m = weights.load_model(p)
        ref, ppl32 = fp32_logits(m), perplexity(m, ids)
        fast = backend.set_backend(m, quant.GGUF.name, "numba")
        a, ppl = agreement(fast, ref), perplexity(fast, ids)
        packed, file_bytes = step_bytes(fast)
        print(f"{Path(p).name}: {tiles(fast)} | step {packed / 1e6:.1f} MB (file {file_bytes / 1e6:.1f} MB) | "
              f"top-1 {a.top1:.1%} of {a.positions} (widest flip {a.max_flip_margin:.2f}) | "
              f"ppl {ppl:.4f} / {ppl32:.4f} = {ppl / ppl32:.4f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
