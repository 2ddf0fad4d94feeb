"""Save, or check bit for bit, the logits of every forward the kernels run: a refactor of kernels/ must not move a bit.

    python tools/kernel_bits.py save  OUT.npz  [--weights DIR]    # on the tree before the change
    python tools/kernel_bits.py check OUT.npz  [--weights DIR]    # on the tree after it: np.array_equal on each

It drives the Engine (greedy) on the real model in two modes, `auto` (the default path) and `w8a8`, and records the
logits of every forward: a prefill (the three-call path), decode at batch 1 and batch 16 (the fused decode step),
and speculative verifies (ngram drafts, k + 1 rows in one fused step). Run it with PYTHONPATH pointing at the tree
under test; it uses only the Engine's public arguments and `engine.forward`, which both trees have.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

PROMPT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
          "Write one sentence about the sea.")
SPEC_PROMPT = ("red green blue yellow, " * 6).rstrip()   # the model goes on repeating it: ngram drafts get accepted


def capture(weights: str) -> dict[str, np.ndarray]:
    from tinyserve import engine as engine_module
    from tinyserve.sampling import SamplingParams
    from tinyserve.tokenizer import load_tokenizer
    from tinyserve.weights import load_model

    tok = load_tokenizer(weights)
    ids = tok.encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)   # every step runs: no early EOS
    out: dict[str, np.ndarray] = {}
    real_forward = engine_module.forward
    from tinyserve.kernels import decode_step as fused            # count the steps the fused kernel ran
    real_fused, fused_calls = fused.decode_step, [0]

    def counting(*a, **k):
        fused_calls[0] += 1
        return real_fused(*a, **k)

    fused.decode_step = counting
    for quant in ("auto", "w8a8"):
        model = load_model(weights, quant=quant, backend="numba")
        for name, prompts, spec in (("b1", [ids], {}), ("b16", [ids[i:] for i in range(16)], {}),
                                    ("spec", [tok.encode(SPEC_PROMPT)], {"speculative": "ngram", "draft_k": 4})):
            calls: list[np.ndarray] = []

            def recording(*a, **k):
                logits = real_forward(*a, **k)
                calls.append(np.array(logits, copy=True))
                return logits

            engine_module.forward = recording
            try:
                eng = engine_module.Engine(model, num_blocks=128, block_size=16, max_batch_tokens=1024, **spec)
                eng.generate(prompts, params)
            finally:
                engine_module.forward = real_forward
            for i, logits in enumerate(calls):
                out[f"{quant}/{name}/{i}:{logits.shape[0]}"] = logits
            print(f"{quant} {name}: {len(calls)} forwards, rows {[c.shape[0] for c in calls]}, fused decode steps "
                  f"so far {fused_calls[0]}", file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["save", "check"])
    p.add_argument("path")
    p.add_argument("--weights", default="weights/smollm2-135m-instruct")
    args = p.parse_args()
    got = capture(args.weights)
    if args.what == "save":
        np.savez(args.path, **got)
        print(f"saved {len(got)} logit arrays to {args.path}")
        return 0
    want = dict(np.load(args.path))
    bad = [k for k in want if k not in got or not np.array_equal(want[k], got[k])]
    extra = sorted(set(got) - set(want))
    for k in bad:
        print(f"DIFFERENT: {k}" + ("" if k in got else " (missing)"))
    for k in extra:
        print(f"NEW: {k}")
    print(f"{len(want) - len(bad)}/{len(want)} logit arrays bit-identical")
    return 1 if bad or extra else 0


if __name__ == "__main__":
    sys.exit(main())
