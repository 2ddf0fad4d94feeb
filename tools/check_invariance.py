#!/usr/bin/env python
"""Does a greedy answer depend on who else is in the batch? The table of docs/batch-invariance.md.

    PYTHONPATH=. python tools/check_invariance.py                  # default path (--quant auto, numba)
    TINYSERVE_KERNELS=avx2 PYTHONPATH=. python tools/check_invariance.py
    PYTHONPATH=. python tools/check_invariance.py --quant w8a8 --tokens 32
    PYTHONPATH=. python tools/check_invariance.py --weights weights/gemma3-270m/gemma-3-270m-q4_k_m.gguf   # lesson 11

16 chat prompts (not the tests' prompts), 48 greedy tokens each with EOS ignored, decoded alone in an Engine (the
reference), then every other way a user can meet them: all 16 in one batch, in batches of 4, through
kv_cache.generate (what `tinyserve generate` runs: a contiguous cache), with prefix caching, with the prompts chunked
(max_batch_tokens), with preemption (a pool too small for all 16) and with greedy speculative decoding. Each row
prints how many of the 16 token sequences differ from the reference and where the first difference falls.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

QUESTIONS = [
    "Why does bread go stale faster in the fridge?",
    "Give me three tips for a first marathon.",
    "What is the difference between a comet and an asteroid?",
    "Write a haiku about a lighthouse in fog.",
    "How do I explain recursion to a ten-year-old?",
    "Which spices go well with roasted carrots?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What should I pack for a weekend of winter camping?",
    "Why is the ocean salty but rivers are not?",
    "Suggest a name for a grey kitten that likes to climb.",
    "How does a bicycle stay upright when it moves?",
    "What are good habits for learning a new language?",
    "Explain what a mortgage is in plain words.",
    "Why do cats purr?",
    "List four uses for baking soda around the house.",
    "How can I make my houseplants grow better in winter?",
]
SYSTEM = "You are a friendly assistant who answers briefly and clearly."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--weights", default=None)
    args = ap.parse_args()

    import tinyserve as ts
    from tinyserve.engine import Engine
    from tinyserve.kv_cache import generate
    from tinyserve.sampling import SamplingParams
    from tinyserve.tokenizer import load_tokenizer
    from tinyserve.weights import DEFAULT_WEIGHTS_DIR

    wdir = args.weights or DEFAULT_WEIGHTS_DIR
    model = ts.load_model(wdir, quant=args.quant, backend="numba")
    tok = load_tokenizer(wdir)
    if str(wdir).endswith(".gguf") and model.config.arch == "gemma3":   # a base model: plain completion prompts
        prompts = [tok.encode(f"{SYSTEM}\n\nQuestion: {q}\nAnswer:", add_bos=True) for q in QUESTIONS]
    else:
        prompts = [tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
                   for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_new_tokens=args.tokens, ignore_eos=True)

    def engine_run(batches, **kw) -> list[list[int]]:
        out = []
        for group in batches:
            eng = Engine(model, **kw)
            out += [list(t) for t in eng.generate([prompts[i] for i in group], params)]
        return out

    t0 = time.perf_counter()
    ref = engine_run([[i] for i in range(16)])
    rows = [
        ("the 16 decoded together (B=16)", lambda: engine_run([range(16)])),
        ("in batches of 4", lambda: engine_run([range(i, i + 4) for i in range(0, 16, 4)])),
        ("kv_cache.generate (contiguous cache)", lambda: [generate(model, p, params=params) for p in prompts]),
        ("B=16 with prefix caching on", lambda: engine_run([range(16)], prefix_caching=True)),
        ("B=16, prompts chunked (max_batch_tokens=40)", lambda: engine_run([range(16)], max_batch_tokens=40)),
        ("B=16, preempted (pool of 40 blocks of 16)", lambda: engine_run([range(16)], num_blocks=40)),
        ("B=16, greedy speculative (n-gram, k=4)", lambda: engine_run([range(16)], speculative="ngram", draft_k=4)),
    ]
    from tinyserve.kernels import isa
    print(f"quant {model.quant!r}, kernels {isa.describe()}; "
          f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
          f"{args.tokens} greedy tokens, EOS ignored; reference: each prompt alone in an Engine")
    print("| compared with each prompt decoded alone in an Engine | sequences that differ | first difference at token |")
    print("|---|---|---|")
    total = 0
    for name, run in rows:
        got = run()
        firsts = [next(j for j, (a, b) in enumerate(zip(r, g)) if a != b) for r, g in zip(ref, got) if r != g]
        total += len(firsts)
        where = f"{min(firsts)}-{max(firsts)}" if firsts else "–"
        print(f"| {name} | {len(firsts)} of {len(prompts)} | {where} |", flush=True)
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
