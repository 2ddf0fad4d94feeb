#!/usr/bin/env python
"""Speculative decoding on SmolLM2: acceptance α and speed-up vs k, per drafter and workload, in one run.

    python tools/bench_speculative.py                      # the full sweep (long: run it on a quiet machine)
    python tools/bench_speculative.py --ks 4 --reps 1      # a quick look

Every configuration decodes the same greedy tokens as plain KV-cache decoding (checked on every run). Runs are
interleaved: each repetition times plain decoding and then every (drafter, k) once per workload, so slow phases of
a shared machine hit all of them alike; the speed-up of a configuration is the median over repetitions of
(plain time / its time) within the same repetition, with the min-max spread.

The prediction next to each measurement uses roofline.speculative_tokens_per_step with the α measured in that very
run, and two cost models: the roofline's (a verify step costs one decode step, drafting costs `cost` per token)
and the measured one (verify of k + 1 rows and the draft time per token, both timed on this machine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import tinyserve as ts  # noqa: E402
from tinyserve import kv_cache, speculative as sp  # noqa: E402
from tinyserve.drafters import ModelDrafter, NgramDrafter, early_exit_model  # noqa: E402
from tinyserve.kernels.decode_step import MAX_ROWS  # noqa: E402
from tinyserve.measure import Spread, format_table, time_repeated  # noqa: E402
from tinyserve.roofline import speculative_tokens_per_step  # noqa: E402

DOC = ("Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity. She was the "
       "first woman to win a Nobel Prize, the first person to win a Nobel Prize twice, and the only person to win "
       "a Nobel Prize in two scientific fields. Her husband, Pierre Curie, was a co-winner of her first Nobel "
       "Prize. She was born in Warsaw, in what was then the Kingdom of Poland, and moved to Paris in 1891 to "
       "study at the University of Paris, where she earned her higher degrees.")

WORKLOADS = {
    "code": "Write a Python function merge_sorted(a, b) that merges two sorted lists into one sorted list. "
            "Include a docstring.",
    "extractive": "Repeat the following text exactly, word for word:\n\n" + DOC,
    "chat": "What are three good habits for staying focused while studying?",
}


class TimedDrafter:
    """Wraps a drafter to time its proposals (for the measured draft cost per token)."""

    def __init__(self, inner):
        self.inner, self.name, self.cost = inner, inner.name, inner.cost
        self.seconds, self.tokens = 0.0, 0

    def propose(self, context, k, params, rng):
        t0 = time.perf_counter()
        draft = self.inner.propose(context, k, params, rng)
        self.seconds += time.perf_counter() - t0
        self.tokens += len(draft)
        return draft


def decode_time(stream) -> tuple[list[int], float]:
    """Run a token stream; return (tokens, seconds per token of the decode phase).

    The decode phase starts when the prompt's prefill has delivered the first token (plain and speculative alike)
    and ends at the last token, so prefill, which both pay alike, is left out of the rate."""
    out: list[int] = []
    t_first = 0.0
    for tok in stream:
        out.append(tok)
        if len(out) == 1:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    n = len(out) - 1
    if n <= 0:
        raise SystemExit("the first step produced every token: ask for more --new-tokens")
    return out, (t_end - t_first) / n


def parse_ks(text: str) -> list[int]:
    """"2,4" -> [2, 4]; "" -> [] (that drafter is left out of the run)."""
    return [int(k) for k in text.split(",") if k.strip()]


def drafter_lineup(model, args) -> dict:
    """name -> (factory of a fresh drafter, k values to sweep); a drafter with no k values is left out."""
    lineup = {"ngram": (lambda: NgramDrafter(), parse_ks(args.ks))}
    L, ee_ks, int8_ks = args.early_exit_layers, parse_ks(args.early_exit_ks), parse_ks(args.int8_ks)
    if ee_ks:
        ee = early_exit_model(model, L)
        lineup[f"early-exit-{L}"] = (lambda: ModelDrafter(ee, name=f"early-exit-{L}", target=model), ee_ks)
    if int8_ks and args.target != "fp32":
        print(f"(the target is the {model.quant} model itself: no int8 drafter)")
    elif int8_ks:
        int8 = load(args, quant="int8", backend="numba")
        # cost: measured, relative to the float32 target's decode step (the bandwidth ratio would say ~1/4)
        cost = decode_seconds(int8) / decode_seconds(model)
        print(f"int8 draft model (Numba): one decode step costs {cost:.2f} of the float32 target's")
        lineup["int8"] = (lambda: ModelDrafter(int8, name="int8", target=model, cost=cost), int8_ks)
    return lineup


def load(args, **kw):
    return ts.load_model(args.weights, **kw) if args.weights else ts.load_model(**kw)


def decode_seconds(model, history: int = 64, repeat: int = 5) -> float:
    """Median time of one decode step (one row over `history` cached positions), after one untimed."""
    cache = kv_cache.KVCache.allocate(model.config, history + 1)
    kv_cache.forward_with_cache(model, cache, list(range(100, 100 + history)))
    return time_repeated(lambda: kv_cache.forward_with_cache(model, cache, [5]), repeat, warmup=1,
                         reset=lambda: cache.rewind(1)).median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ks", default="1,2,4,8,16,32", help="k values for the n-gram drafter")
    ap.add_argument("--early-exit-ks", default="1,2", help="k values for the early-exit drafter (it costs more)")
    ap.add_argument("--int8-ks", default="2,4", help="k values for the int8 drafter")
    ap.add_argument("--target", default="fp32", choices=["fp32", "auto", "int8", "w8a8", "w8a8-64", "w4a8"],
                    help="the target model: float32 NumPy (default), or lesson 7's quantised weights on the Numba "
                         "backend (auto: the CLI's default mode on this CPU)")
    ap.add_argument("--adaptive-k-max", type=int, default=32)
    ap.add_argument("--early-exit-layers", type=int, default=24)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--weights", default=None)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args()

    model = load(args) if args.target == "fp32" else load(args, quant=args.target, backend="numba")
    if args.target != "fp32":
        from tinyserve.kernels import isa
        print(f"target: quant={model.quant}, {isa.describe()}")
    tok = ts.load_tokenizer(args.weights) if args.weights else ts.load_tokenizer()
    greedy = ts.SamplingParams(temperature=0)
    lineup = drafter_lineup(model, args)
    workloads = {w: tok.encode_chat([{"role": "user", "content": WORKLOADS[w]}]) for w in args.workloads.split(",")}
    print("measuring the verify cost of k + 1 rows ...", flush=True)
    verify_costs = sp.measure_verify_costs(model, max(args.adaptive_k_max, *[k for _, ks in lineup.values() for k in ks]))
    print("verify cost (x a decode step) at k = 0..: " + " ".join(f"{c:.2f}" for c in verify_costs))

    configs = [(name, k, False) for name, (_, ks) in lineup.items() for k in ks]
    configs += [(name, args.adaptive_k_max if name == "ngram" else max(ks), True) for name, (_, ks) in lineup.items()]
    rows: dict[tuple, dict] = {}
    base_times: dict[str, list[float]] = {w: [] for w in workloads}
    differs = 0
    for rep in range(args.reps):
        for w, ids in workloads.items():
            expected, t_base = decode_time(kv_cache.generate_stream(model, ids, args.new_tokens, greedy))
            base_times[w].append(t_base)
            for name, k, adaptive in configs:
                drafter = TimedDrafter(lineup[name][0]())
                stats = sp.SpecStats()
                out, t = decode_time(sp.generate_stream(
                    model, ids, args.new_tokens, greedy, drafter=drafter, k=k, adaptive=adaptive, stats=stats,
                    verify_costs=verify_costs if adaptive else None))
                # The same tokens where every verify runs in the fused step (k + 1 <= MAX_ROWS rows: each row is a
                # decode step's, bit for bit; tests/test_speculative.py) and in float32. A longer verify, or a fused
                # step that fell back, runs the three-call path, whose float order differs by ~1e-7; int8
                # activations can round that apart at a near tie: count such runs
                if out != expected and model.quant in ("none", "int8"):
                    raise AssertionError(f"{name} k={k}: greedy speculative output differs from plain decoding")
                differs += out != expected
                r = rows.setdefault((w, name, k, adaptive), {"speedup": [], "alpha": [], "tps": [], "tok_step": [],
                                                             "draft_s_per_tok": [], "ks": []})
                r["speedup"].append(t_base / t)    # both are seconds per decoded token
                r["alpha"].append(stats.alpha)
                r["tok_step"].append(stats.tokens_per_step)
                r["tps"].append(1 / t)
                r["draft_s_per_tok"].append(drafter.seconds / max(drafter.tokens, 1))
                r["ks"].append(statistics.mean(stats.ks) if stats.ks else 0)
                print(f"rep {rep} {w:>10} {name:>14} k={k:<2}{'a' if adaptive else ' '} "
                      f"α={stats.alpha:.2f} tok/step={stats.tokens_per_step:.2f} x{t_base / t:.2f}", flush=True)

    backend = "fp32 NumPy" if args.target == "fp32" else f"{model.quant} Numba (lesson 7)"
    if differs:
        print(f"\n{differs} of {len(configs) * len(workloads) * args.reps} speculative runs decoded other tokens than "
              f"plain decoding somewhere (verifies of more than {MAX_ROWS} rows or a fused step that fell back, int8 "
              f"activations: float order at a near tie, see above)")
    print(f"\nSmolLM2-135M-Instruct target: {backend}, greedy, {args.new_tokens} new tokens, {args.reps} interleaved "
          f"repetitions; speed-up = median (min-max) of plain/speculative decode time per token in the same "
          f"repetition, plain decoding on the same backend.")
    print("plain decode tokens/s (median): " + ", ".join(
        f"{w} {1 / statistics.median(ts_):.2f}" for w, ts_ in base_times.items()))
    table = [["workload", "drafter", "k", "α", "tokens/step", "predicted (roofline)", "predicted (measured costs)",
              "measured speed-up", "decode tokens/s"]]
    results = []
    for (w, name, k, adaptive), r in rows.items():
        a = statistics.median(r["alpha"])
        a = 0.0 if a != a else a          # no draft ever verified (nan): α = 0 for the prediction
        step = statistics.median(base_times[w])                            # seconds per plain decode step
        c_draft = statistics.median(r["draft_s_per_tok"]) / step
        k_eff = statistics.median(r["ks"]) if adaptive else k
        kk = int(round(k_eff))
        e = speculative_tokens_per_step(min(a, 1.0), kk)
        pred_roof = e / (1 + kk * lineup[name][0]().cost)
        pred_meas = e / (verify_costs[kk] + kk * c_draft)
        label = f"adaptive ≤{k} (mean {k_eff:.1f})" if adaptive else str(k)
        table.append([w, name, label, f"{a:.2f}", f"{statistics.median(r['tok_step']):.2f}", f"{pred_roof:.2f}x",
                      f"{pred_meas:.2f}x", Spread.of(r["speedup"]).fmt(2, "x"), f"{statistics.median(r['tps']):.2f}"])
        results.append({"workload": w, "drafter": name, "k": k, "adaptive": adaptive, "alpha": a,
                        "predicted_roofline": pred_roof, "predicted_measured": pred_meas, "speedup": r["speedup"],
                        "tokens_per_s": r["tps"], "tokens_per_step": r["tok_step"], "mean_k": k_eff})
    print("\n" + format_table(table, markdown=True))
    if args.json:
        Path(args.json).write_text(json.dumps({"verify_costs": verify_costs, "base_times": base_times,
                                               "new_tokens": args.new_tokens, "results": results}, indent=1))


if __name__ == "__main__":
    main()
