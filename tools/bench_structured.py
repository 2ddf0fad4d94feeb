#!/usr/bin/env python
"""Structured output's cost on SmolLM2, in one run: constrained vs free decoding at B = 1 and B = 16, the mask
machinery's pieces, and jump-forward's speed-up.

    python tools/bench_structured.py                  # ~5 min on a quiet 2-core machine
    python tools/bench_structured.py --rounds 1       # a quick look

1. Decode cost: B greedy requests through the Engine (default quant, Numba), free text (ignore_eos) and the same
   prompts under a JSON schema (jump-forward off here, so both run one token per step). Rounds are interleaved
   (free, constrained, free, ...); a round's figure is the median time of its steps in which all B requests were
   decoding one token each, mask work included; the cost is the median over rounds of constrained / free.
   The grammar's masks are warm after the first round (cached per state); the cold cost is item 2.
2. The mask machinery: every state the runs met, its mask recomputed uncached (the trie walk), with and without
   the plain-token shortcut inside strings, and the per-token check without a trie for a few states.
3. Jump-forward: B = 1, a schema of long keys (all required: forced text), jump-forward on vs off, interleaved;
   wall time per request and engine steps.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import tinyserve as ts  # noqa: E402
from tinyserve.constrained import DEAD, grammars_for  # noqa: E402
from tinyserve import engine as engine_mod  # noqa: E402
from tinyserve.engine import Engine  # noqa: E402

PEOPLE = {"type": "array", "minItems": 4, "items": {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 2}},
    "required": ["name", "age", "city", "hobbies"]}}
ORDER = {"type": "object", "properties": {      # long keys, short values: mostly forced text
    "customer_account_identifier_number_in_our_system": {"type": "integer"},
    "total_number_of_items_in_this_order": {"type": "integer"},
    "is_this_order_to_be_wrapped_as_a_gift": {"type": "boolean"},
    "preferred_delivery_time_window_description": {"enum": ["morning", "afternoon", "evening"]},
    "has_the_customer_agreed_to_the_terms_and_conditions": {"type": "boolean"}}}
ORDER["required"] = list(ORDER["properties"])
TOPICS = ["friends", "scientists", "painters", "athletes", "chefs", "pilots", "writers", "singers"]


def prompts(tok, B: int) -> list[list[int]]:
    return [tok.encode_chat([{"role": "user", "content": f"List some {TOPICS[i % len(TOPICS)]} as JSON, with "
                              f"name, age, city and hobbies."}]) for i in range(B)]


def timed_sampling(spent: list[float]):
    """Wrap the Engine's sampling step (mask, sample, advance, jump-forward) to add its time to spent[0]."""
    real = engine_mod.sample_tokens

    def timed(seq, logits, seen=()):
        t0 = time.perf_counter()
        try:
            return real(seq, logits, seen)
        finally:
            spent[0] += time.perf_counter() - t0
    return timed


def decode_steps(model, tok, B: int, new_tokens: int, schema) -> tuple[float, int, float]:
    """(median seconds of the steps where all B requests decode one token, how many such steps, seconds spent in
    the sampling step per generated token)."""
    engine = Engine(model, tokenizer=tok, num_blocks=(8 + new_tokens // 16) * B + 8, max_batch_tokens=2048,
                    max_running=B)
    params = ts.SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=schema is None,
                               json_schema=schema)
    spent = [0.0]
    engine_mod.sample_tokens, real = timed_sampling(spent), engine_mod.sample_tokens
    try:
        outs = engine.generate(prompts(tok, B), params)
    finally:
        engine_mod.sample_tokens = real
    times = [s.seconds for s in engine.stats if s.num_seqs == B and s.num_decode == B and s.num_tokens == B]
    return statistics.median(times), len(times), spent[0] / sum(map(len, outs))


def mask_machinery(grammar) -> dict:
    """Recompute every cached state's mask: trie walk with the plain shortcut, without it, and the plain loop."""
    a, vocab = grammar.automaton, grammar.vocab
    rows = {True: [], False: []}            # in a string or not -> [(trie, trie without shortcut, no trie)] ms
    for sid in list(grammar.masks):
        t0 = time.perf_counter()
        m = grammar.compute_mask(sid)
        t1 = time.perf_counter()
        m2 = grammar.compute_mask(sid, use_plain=False)
        t2 = time.perf_counter()
        for data in vocab.token_bytes:      # no trie: every token's bytes read from the state, one by one
            if data:
                a.walk(sid, data)
        t3 = time.perf_counter()
        assert (m == m2).all()
        rows[a.string_split(sid)[0] != DEAD].append((1e3 * (t1 - t0), 1e3 * (t2 - t1), 1e3 * (t3 - t2)))
    out = {}
    for inside, r in rows.items():
        if r:
            out["in_string" if inside else "elsewhere"] = {
                "states": len(r), "trie_ms": statistics.mean(x[0] for x in r),
                "trie_no_plain_shortcut_ms": statistics.mean(x[1] for x in r),
                "no_trie_ms": statistics.mean(x[2] for x in r)}
    return out


def jump_forward(model, tok, on: bool) -> tuple[float, int, int]:
    """(seconds, engine steps, output tokens) of one greedy ORDER request at B = 1."""
    grammars_for(tok, model.config.vocab_size, model.config.eos_token_ids).get(ORDER).jump_forward = on
    engine = Engine(model, tokenizer=tok, num_blocks=64)
    ids = tok.encode_chat([{"role": "user", "content": "Make up an order as JSON."}])
    t0 = time.perf_counter()
    out = engine.generate([ids], ts.SamplingParams(temperature=0, max_new_tokens=300, json_schema=ORDER))[0]
    assert engine.finished[0].finish_reason == "stop", tok.decode(out)
    json.loads(tok.decode(out))            # every constrained answer parses
    return time.perf_counter() - t0, len(engine.stats), len(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request in the decode-cost runs")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    tok = ts.load_tokenizer()
    model = ts.load_model(quant="auto", backend="numba")
    grammar = grammars_for(tok, model.config.vocab_size, model.config.eos_token_ids).get(PEOPLE)
    grammar.jump_forward = False
    t0 = time.perf_counter()
    decode_steps(model, tok, 1, 8, PEOPLE)  # warm-up: the kernels load (or compile) here, outside the timings
    print(f"warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": platform.processor() or
              _cpu_name(), "commit": _commit(), "quant": model.quant, "decode": {}}
    for B in map(int, args.batches.split(",")):
        ratios, free_s, con_s, sampling = [], [], [], []
        for r in range(args.rounds):
            f, nf, sf = decode_steps(model, tok, B, args.tokens, None)
            c, nc, sc = decode_steps(model, tok, B, args.tokens, PEOPLE)
            ratios.append(c / f)
            free_s.append(f)
            con_s.append(c)
            sampling.append((sf, sc))
            print(f"B={B} round {r}: free {B / f:.1f} tok/s ({nf} steps), constrained {B / c:.1f} tok/s "
                  f"({nc} steps), cost {100 * (c / f - 1):+.1f} %; sampling step per token: free "
                  f"{1e6 * sf:.0f} us, constrained {1e6 * sc:.0f} us", file=sys.stderr)
        result["decode"][B] = {"free_tok_s": B / statistics.median(free_s), "constrained_tok_s":
                               B / statistics.median(con_s), "cost_median": statistics.median(ratios) - 1,
                               "cost_min": min(ratios) - 1, "cost_max": max(ratios) - 1,
                               "free_step_s": statistics.median(free_s), "constrained_step_s":
                               statistics.median(con_s),
                               "sampling_us_per_token_free": 1e6 * statistics.median(a for a, _ in sampling),
                               "sampling_us_per_token_constrained": 1e6 * statistics.median(b for _, b in sampling)}
    result["masks"] = mask_machinery(grammar)
    print(f"masks: {result['masks']}", file=sys.stderr)
    runs = {True: [], False: []}
    for r in range(args.rounds):
        for on in (False, True):
            runs[on].append(jump_forward(model, tok, on))
    ratio = statistics.median(off[0] / on[0] for off, on in zip(runs[False], runs[True]))
    result["jump_forward"] = {"speedup_median": ratio, "on": runs[True], "off": runs[False]}
    print(f"jump-forward: off {runs[False]}, on {runs[True]}, speed-up {ratio:.2f}x", file=sys.stderr)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
