"""Check a GGUF file on tinyserve against itself and against llama.cpp: the numbers of docs/your-own-model.md.

    .venv-llama/bin/python tools/check_gguf.py llama FILE.gguf OUT.npz     # llama.cpp: ids + logits (its venv)
    .venv/bin/python tools/check_gguf.py compare FILE.gguf OUT.npz [QUANT] # tinyserve: float, fast, llama.cpp
    .venv/bin/python tools/check_gguf.py stages FILE.gguf OUT.npz          # which stage costs the agreement
    .venv/bin/python tools/check_gguf.py heads FILE.gguf OUT.npz           # the LM head in fewer bits

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
from typing import NamedTuple

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


STAGE_ROLES = {"Q|K|V": ("wq", "wk", "wv"), "O": ("wo",), "gate|up": ("w_gate", "w_up"), "down": ("w_down",)}


class FloatInput:
    """A quantised matrix multiplied with float32 activations: x @ its dequantized weights (the fast path's weights,
    not the file's floats), so only the rounding of this matrix's input is taken away."""
    __array_ufunc__ = None

    def __init__(self, q):
        self.w = q.dequantize()                  # [D_in, O] float32

    @property
    def shape(self):
        return self.w.shape

    def __rmatmul__(self, x):
        return x @ self.w


class OnTiles(NamedTuple):
    """What stages and heads start from: llama.cpp's file (step 1), its ids, the float path, the quantised model,
    the reference's steps over its tiles (kernels/block_forward.py, fuse=False: the fast path's bits) and the
    float path's attention (naive's NumPy, as compare)."""
    data: object
    ids: list
    float_model: object
    quantised: object
    tiled: object
    attention: object


def on_tiles(gguf: str, npz: str) -> OnTiles:
    sys.path.insert(0, str(ROOT))
    import tinyserve as ts
    from tinyserve import naive
    from tinyserve.kernels.block_forward import prepare as prepare_tiles

    data = np.load(npz)
    float_model = ts.load_model(gguf)
    quantised = ts.load_model(gguf, quant="auto", backend="numba")
    return OnTiles(data, data["ids"].tolist(), float_model, quantised, prepare_tiles(quantised, fuse=False).tiled,
                   naive._attention(float_model))


def stages(gguf: str, npz: str) -> list[dict]:
    """The fast path's agreement with the float path with one stage at a time taken away: each role's activations
    in float32 (FloatInput) on the reference's steps over the tiles (kernels/block_forward.py, fuse=False: the fast
    path's bits), and gate|up's input in one int8 plane (the path before quant.two_planes). Same windows, same
    attention (naive's NumPy) as compare."""
    import dataclasses
    from tinyserve.model import forward

    data, ids, float_model, quantised, tiled, attention = on_tiles(gguf, npz)

    def run(model) -> tuple[np.ndarray, np.ndarray]:
        stats = [window_stats(forward(model, np.asarray(w), np.arange(len(w)), attention), w) for _, w in windows(ids)]
        return np.concatenate([t for t, _ in stats]), np.concatenate([n for _, n in stats])

    def variant(float_roles=(), head=False, planes=None):
        layers = []
        for tl, ql in zip(tiled.layers, quantised.layers):
            rep = {f: FloatInput(getattr(ql, f)) for r in float_roles for f in STAGE_ROLES[r]}
            if planes is not None:
                rep |= {f: dataclasses.replace(getattr(tl, f), planes=planes) for f in STAGE_ROLES["gate|up"]}
            layers.append(dataclasses.replace(tl, **rep))
        return dataclasses.replace(tiled, layers=layers,
                                   lm_head_q=FloatInput(quantised.lm_head_q) if head else tiled.lm_head_q)
    float_top1, float_nll = run(float_model)
    rows = []
    for name, model in [("the fast path", variant()), ("gate|up's input in one int8 plane", variant(planes=1))] + \
                       [(f"{r}'s input in float32", variant([r])) for r in STAGE_ROLES] + \
                       [("the head's input in float32", variant(head=True)),
                        ("every input in float32 (the fast path's weights)", variant(list(STAGE_ROLES), head=True))]:
        top1, nll = run(model)
        rows.append({"stage": name, "top1_vs_float": float(np.mean(top1 == float_top1)),
                     "ppl_ratio": perplexity(nll) / perplexity(float_nll),
                     "top1_vs_llama": float(np.mean(top1 == llama_stats(data)[0]))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def requantize(w: np.ndarray, bits: int, with_min: bool) -> np.ndarray:
    """[D, O] float32 -> its values after llama.cpp's rule per 32 inputs (Q4_1/Q5_1 with_min: d = (max - min) /
    (2^bits - 1), m = min; Q4_0/Q5_0: d = the largest-magnitude value / -2^(bits-1), m = -2^(bits-1) d), d and m
    rounded to float16 as the files keep them."""
    D, O = w.shape
    b = w.reshape(D // 32, 32, O)
    top = 2 ** bits - 1
    f16 = lambda a: a.astype(np.float16).astype(np.float32)            # noqa: E731
    if with_min:
        lo = b.min(axis=1)
        d, m = f16((b.max(axis=1) - lo) / np.float32(top)), f16(lo)
    else:
        big = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)[:, 0]
        d = f16(big / np.float32(-(top + 1) // 2))
        m = f16(np.float32(-(top + 1) // 2) * d)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] != 0, np.rint((b - m[:, None]) / d[:, None]), 0)
    return (d[:, None] * np.clip(q, 0, top) + m[:, None]).reshape(D, O)


HEAD_RULES = {"Q5_1's rule": (5, True), "Q5_0's rule": (5, False), "Q4_1's rule": (4, True),
              "Q4_0's rule": (4, False)}


def heads(gguf: str, npz: str) -> list[dict]:
    """The fast path with its LM head requantized to fewer bits (HEAD_RULES), everything else as it runs: the head's
    input is recorded once on the reference's steps over the tiles (as in stages), rounded to int8 per 32 as the
    tiles round it, and multiplied by each narrower head's values (in float32: the tile adds the same exact integer
    products, in another order)."""
    import dataclasses
    from tinyserve import naive
    from tinyserve.model import forward
    from tinyserve.quant import quantize_blocks

    data, ids, float_model, quantised, tiled, attention = on_tiles(gguf, npz)
    head_inputs = []

    class Recorder:                          # the tiled head, keeping what it is given
        __array_ufunc__ = None
        shape = tiled.lm_head_q.shape

        def __rmatmul__(self, x):
            head_inputs.append(np.array(x))
            return x @ tiled.lm_head_q

    def stats(logits: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        both = [window_stats(lg, w) for lg, (_, w) in zip(logits, windows(ids))]
        return np.concatenate([t for t, _ in both]), np.concatenate([n for _, n in both])

    def as_tiles_round(x: np.ndarray) -> np.ndarray:       # [T, D] -> its int8-per-32 values
        xq, sx = quantize_blocks(x, x.shape[1] // 32)
        return (xq.reshape(len(x), -1, 32) * sx[:, :, None]).reshape(x.shape).astype(np.float32)

    float_top1, float_nll = stats([naive.forward(float_model, w) for _, w in windows(ids)])
    recording = dataclasses.replace(tiled, lm_head_q=Recorder())
    now = stats([forward(recording, np.asarray(w), np.arange(len(w)), attention) for _, w in windows(ids)])
    head = quantised.lm_head_q.dequantize()                                      # [D, V]
    rows = []
    for name, (bits, with_min) in [("the file's", (None, None)), *HEAD_RULES.items()]:
        if bits is None:
            top1, nll = now
        else:
            w = requantize(head, bits, with_min)
            top1, nll = stats([as_tiles_round(x) @ w for x in head_inputs])
        rows.append({"head": name, "top1_vs_float": float(np.mean(top1 == float_top1)),
                     "ppl_ratio": perplexity(nll) / perplexity(float_nll),
                     "top1_vs_llama": float(np.mean(top1 == llama_stats(data)[0]))})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1] == "llama":
        llama_side(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "stages":
        stages(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "heads":
        heads(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(compare(sys.argv[2], sys.argv[3], *sys.argv[4:5])))
