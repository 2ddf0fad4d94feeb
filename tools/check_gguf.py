"""Check a GGUF file on tinyserve against itself and against llama.cpp: the numbers of docs/your-own-model.md.

    .venv-llama/bin/python tools/check_gguf.py llama FILE.gguf OUT.npz     # llama.cpp: ids + logits (its venv)
    .venv/bin/python tools/check_gguf.py compare FILE.gguf OUT.npz [QUANT] # tinyserve: float, fast, llama.cpp

Step 1 tokenizes tests/fixtures/perplexity_text.txt with llama.cpp's own tokenizer (so any family works, whatever
tinyserve's tokenizer does) and teacher-forces PPL_TOKENS of it in windows of PPL_WINDOW (tests/quant_accuracy.py's
measurement), keeping per position llama.cpp's top-1 token and the log-probability it gives the next one (not the
logits: a 262k-token vocabulary makes those gigabytes). Step 2 runs the same ids through tinyserve's float32 path
(the reference) and its fast path (quant="auto", the Numba kernels), a window at a time, and prints:

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


def windows(ids: list[int]) -> list[tuple[int, list[int]]]:
    """(start, ids) of each teacher-forced window."""
    return [(s, ids[s:s + PPL_WINDOW]) for s in range(0, len(ids), PPL_WINDOW)]


def window_stats(logits: np.ndarray, window: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A window's logits [n, V] -> per position that predicts the window's next id (all but the last): top-1 [n-1]
    and negative log-likelihood of that id [n-1] float32 (each row on its own: the same bits a window or all)."""
    logits, nxt = logits[:len(window) - 1], np.asarray(window[1:])
    m = logits.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(-1))
    return logits.argmax(-1), lse - logits[np.arange(len(nxt)), nxt]


def perplexity(nll: np.ndarray) -> float:   # the float32 mean, exponentiated in float64
    return float(np.exp(float(np.mean(nll))))


def llama_side(gguf: str, out: str) -> None:
    import llama_cpp
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=PPL_WINDOW, n_batch=PPL_WINDOW, logits_all=True, n_threads=2,
                          verbose=False)
    text = TEXT.read_text().split("\n", 1)[1]
    ids = llm.tokenize(text.encode(), add_bos=False, special=False)[:PPL_TOKENS]
    top1, nll = [], []
    for _, window in windows(ids):
        llm.reset()
        llm.eval(window)
        t, n = window_stats(np.array(llm.scores[:len(window)], dtype=np.float32), window)
        top1.append(t)
        nll.append(n)
    np.savez(out, ids=np.array(ids), top1=np.concatenate(top1), nll=np.concatenate(nll))


def llama_stats(data) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's top-1 and NLL per predicting position from step 1's file (or from an older file's logits)."""
    if "top1" in data:
        return data["top1"], data["nll"]
    ids, logits = data["ids"].tolist(), data["logits"]
    stats = [window_stats(logits[s:s + len(w)], w) for s, w in windows(ids)]
    return np.concatenate([t for t, _ in stats]), np.concatenate([n for _, n in stats])


def compare(gguf: str, npz: str, quant: str = "auto") -> dict:
    sys.path.insert(0, str(ROOT))
    import tinyserve as ts
    from tinyserve import naive
    from tinyserve.backend import prepare

    data = np.load(npz)
    ids = data["ids"].tolist()
    ref_top1, ref_nll = llama_stats(data)
    float_model = ts.load_model(gguf)
    fast_model = prepare(ts.load_model(gguf, quant=quant, backend="numba"))
    stats = {"float": ([], []), "fast": ([], [])}
    for _, window in windows(ids):       # one window's logits at a time: [PPL_WINDOW, V]
        for name, model in (("float", float_model), ("fast", fast_model)):
            top1, nll = window_stats(naive.forward(model, window), window)
            stats[name][0].append(top1)
            stats[name][1].append(nll)
    (float_top1, float_nll), (fast_top1, fast_nll) = ((np.concatenate(t), np.concatenate(n))
                                                      for t, n in stats.values())
    res = {"file": Path(gguf).name, "quant": fast_model.quant, "positions": int(len(float_top1)),
           "top1_fast_vs_float": float(np.mean(fast_top1 == float_top1)),
           "ppl_float": perplexity(float_nll),
           "ppl_fast": perplexity(fast_nll),
           "top1_fast_vs_llama": float(np.mean(fast_top1 == ref_top1)),
           "top1_float_vs_llama": float(np.mean(float_top1 == ref_top1)),
           "ppl_llama": perplexity(ref_nll)}
    res["ppl_ratio"] = res["ppl_fast"] / res["ppl_float"]
    return res


if __name__ == "__main__":
    if sys.argv[1] == "llama":
        llama_side(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(compare(sys.argv[2], sys.argv[3], *sys.argv[4:5])))
