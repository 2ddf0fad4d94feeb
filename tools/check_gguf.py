"""Check a GGUF file on tinyserve against itself and against llama.cpp: the numbers of docs/your-own-model.md.

    .venv-llama/bin/python tools/check_gguf.py llama FILE.gguf OUT.npz     # llama.cpp: ids + logits (its venv)
    .venv/bin/python tools/check_gguf.py compare FILE.gguf OUT.npz [QUANT] # tinyserve: float, fast, llama.cpp

Step 1 tokenizes tests/fixtures/perplexity_text.txt with llama.cpp's own tokenizer (so any family works, whatever
tinyserve's tokenizer does) and teacher-forces PPL_TOKENS of it in windows of PPL_WINDOW (tests/quant_accuracy.py's
measurement), keeping llama.cpp's logits of every position. Step 2 runs the same ids through tinyserve's float32 path
(the reference) and its fast path (quant="auto", the Numba kernels) and prints:

    top-1 agreement fast vs float (bound >= 95 %), perplexity fast / float (bound <= 1.02: tests/test_quant_accuracy.py),
    top-1 agreement fast vs llama.cpp and float vs llama.cpp (bound >= 90 %: llama.cpp quantizes activations too).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "tests" / "fixtures" / "perplexity_text.txt"
PPL_WINDOW, PPL_TOKENS = 512, 2048


def llama_side(gguf: str, out: str) -> None:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=PPL_WINDOW, n_batch=PPL_WINDOW, logits_all=True, n_threads=2,
                          verbose=False)
    text = TEXT.read_text().split("\n", 1)[1]
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)[:PPL_TOKENS]
    logits = []
    for start in range(0, len(ids), PPL_WINDOW):
        llm.reset()
        window = ids[start:start + PPL_WINDOW]
        llm.eval(window)
        logits.append(np.array(llm.scores[:len(window)], dtype=np.float32))
    np.savez(out, ids=np.array(ids), logits=np.concatenate(logits))


def _nll(logits: np.ndarray, ids: np.ndarray) -> float:   # [T, V], [T] next tokens -> mean negative log-likelihood
    m = logits.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return float(np.mean(lse - logits[np.arange(len(ids)), ids]))


def compare(gguf: str, npz: str, quant: str = "auto") -> dict:
    sys.path.insert(0, str(ROOT))
    import tinyserve as ts
    from tinyserve import naive
    from tinyserve.backend import prepare

    data = np.load(npz)
    ids, ref = data["ids"].tolist(), data["logits"]
    windows = [ids[s:s + PPL_WINDOW] for s in range(0, len(ids), PPL_WINDOW)]

    def run(model) -> np.ndarray:
        return np.concatenate([naive.forward(model, w) for w in windows])

    float_logits = run(ts.load_model(gguf))
    fast_model = prepare(ts.load_model(gguf, quant=quant, backend="numba"))
    fast_logits = run(fast_model)
    # next-token targets inside each window (the last position of a window predicts nothing here)
    rows = np.concatenate([np.arange(s, s + len(w) - 1) for s, w in zip(range(0, len(ids), PPL_WINDOW), windows)])
    targets = np.array(ids)[rows + 1]
    top = lambda a: a[rows].argmax(-1)   # noqa: E731
    res = {"file": Path(gguf).name, "quant": fast_model.quant, "positions": int(len(rows)),
           "top1_fast_vs_float": float(np.mean(top(fast_logits) == top(float_logits))),
           "ppl_float": float(np.exp(_nll(float_logits[rows], targets))),
           "ppl_fast": float(np.exp(_nll(fast_logits[rows], targets))),
           "top1_fast_vs_llama": float(np.mean(top(fast_logits) == top(ref))),
           "top1_float_vs_llama": float(np.mean(top(float_logits) == top(ref))),
           "ppl_llama": float(np.exp(_nll(ref[rows], targets)))}
    res["ppl_ratio"] = res["ppl_fast"] / res["ppl_float"]
    return res


if __name__ == "__main__":
    if sys.argv[1] == "llama":
        llama_side(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(compare(sys.argv[2], sys.argv[3], *sys.argv[4:5])))
