"""`python -m tinyserve speed` (part of `make bench`): tokens/s per backend against the memory-bandwidth roofline.

Lesson 7's question: how close does each backend come to what the hardware allows? For every backend
(fp32-NumPy, int8-Numba = W8A32, W8A8-Numba, W8A8-64-Numba) it measures, in the same run and interleaved round by round (these
machines are shared and noisy; the table shows the median and the min-max of the rounds, measure.Spread):
- decode tokens/s at batch B: B requests of a 32-token prompt decoding together through the Engine; only the
  steps where all B decode are timed (prefill excluded: measure.decode_rate);
- prefill tokens/s for a prompt of n tokens: one `kv_cache.prefill` into a fresh cache (time to its last logits).
decode_run and prefill_run are the workloads every tokens/s of the course is measured on (tools/bench_peers.py,
tools/bench_variants.py, tools/quant_table.py, lesson 7).
Next to each decode figure: the bytes one step must read (every weight once + the KV cache of the B sequences),
and the share of the roofline bound B / (bytes / bandwidth) it reached, the bandwidth measured on the spot by
roofline.measure_bandwidth (a float32 matrix-vector product over a matrix far larger than the caches, on BLAS's
threads: the access pattern of streaming weights). The instrument must read at the machine's speed: a Numba loop
whose running sums live in an array LLVM cannot keep in registers (it might alias the data) runs scalar, reports
a fraction of the bandwidth, and flatters every roofline share. Measure the measuring instrument too.
"""
from __future__ import annotations

import numpy as np

from . import measure
from .engine import Engine
from .kv_cache import KVCache, prefill
from .measure import Rate, Spread
from .model import Model
from .quant import INT8, NONE, W4A8, W8A8, W8A8_64, bytes_per_decode_step
from .roofline import kv_bytes_per_token, measure_bandwidth
from .sampling import SamplingParams

BACKENDS = {"fp32-NumPy": (NONE.name, "numpy"), "int8-Numba": (INT8.name, "numba"), "W8A8-Numba": (W8A8.name, "numba"),
            "W8A8-64-Numba": (W8A8_64.name, "numba"), "W4A8-Numba": (W4A8.name, "numba")}


def cpu_name() -> str:
    """The CPU's model name, to print beside every speed figure (measure.cpu_name; lesson 7 calls it from here)."""
    return measure.cpu_name()


def decode_run(model: Model, prompts: list[list[int]], new_tokens: int, **engine_kw) -> tuple[Rate, list[list[int]]]:
    """B prompts decoding together through one Engine, greedy, EOS ignored (every sequence makes exactly new_tokens
    tokens); the rate of its plain decode steps (measure.decode_rate) and the B outputs.

    All prompts prefill in the first step (max_batch_tokens covers them) and the B sequences then decode side by
    side, so every step after the first decodes at batch B: B x (new_tokens - 1) tokens are timed.
    engine_kw: passed to Engine (backend=..., ...)."""
    B, P, bs = len(prompts), max(map(len, prompts)), 16
    engine = Engine(model, num_blocks=B * (-(-(P + new_tokens) // bs) + 1), block_size=bs,
                    max_batch_tokens=max(256, sum(map(len, prompts))), max_running=B, **engine_kw)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    engine.run()
    rate = measure.decode_rate(engine.stats)
    # otherwise some step mixed prefill rows into the timing, or a sequence was preempted and decoded alone
    assert rate.tokens == B * (new_tokens - 1), f"decode steps sampled {rate.tokens} tokens, not {B * (new_tokens - 1)}"
    return rate, [list(engine.finished[i].output_ids) for i in ids]


def decode_tokens_per_s(model: Model, batch: int, prompt_len: int = 32, new_tokens: int = 32, seed: int = 0) -> float:
    """Aggregate decode tokens/s of `batch` sequences of random `prompt_len`-token prompts decoding together
    (decode_run: plain decode steps only)."""
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(3, model.config.vocab_size, prompt_len)] for _ in range(batch)]
    return decode_run(model, prompts, new_tokens)[0].tokens_per_s


def prefill_run(model: Model, ids: list[int]) -> tuple[Rate, np.ndarray]:
    """One kv_cache.prefill of `ids` into a fresh contiguous KVCache (the prompt in one forward, the LM head on the
    last row only); its rate (measure.prefill_rate) and the last position's logits [V]."""
    cache = KVCache.allocate(model.config, len(ids))
    return measure.prefill_rate(lambda: prefill(model, cache, ids), len(ids))


def prefill_tokens_per_s(model: Model, n_tokens: int, seed: int = 0) -> float:
    """Tokens/s of one prefill of n_tokens random ids into a fresh KV cache (time to the last position's logits)."""
    ids = [int(t) for t in np.random.default_rng(seed).integers(3, model.config.vocab_size, n_tokens)]
    return prefill_run(model, ids)[0].tokens_per_s


def run(models: dict[str, Model], batches=(1, 4, 16), prefills=(128, 512, 1024), rounds: int = 3,
        new_tokens: int = 32, progress: bool = True) -> dict[tuple[str, str], Spread]:
    """Every (workload, backend) pair `rounds` times, interleaved: round r measures all pairs before round r+1.
    Returns {(workload, backend label): tokens/s over the rounds}."""
    work = [(f"decode B={b}", lambda m, b=b: decode_tokens_per_s(m, b, new_tokens=new_tokens)) for b in batches]
    work += [(f"prefill {n}", lambda m, n=n: prefill_tokens_per_s(m, n)) for n in prefills]
    for m in models.values():                    # warm-up: JIT (or its cache), page in the weights
        decode_tokens_per_s(m, 1, new_tokens=4)
        prefill_tokens_per_s(m, 16)
    samples: dict[tuple[str, str], list[float]] = {}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=rounds * len(work) * len(models), desc="speed", unit="run", leave=False)
    for _ in range(rounds):
        for name, fn in work:
            for label, m in models.items():
                samples.setdefault((name, label), []).append(fn(m))
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return {key: Spread.of(v) for key, v in samples.items()}


def format_report(models: dict[str, Model], results: dict[tuple[str, str], Spread], bandwidth: float, batches,
                  prefills, prompt_len: int = 32, new_tokens: int = 32) -> str:
    """The table: tokens/s (median, min-max) per workload and backend; beside each decode figure the bytes a step
    reads and the share of the roofline bound reached; then every backend's ratios to the first one."""
    labels = list(models)
    lines = [f"read bandwidth (2 threads, measured now): {bandwidth / 1e9:.1f} GB/s",
             "tokens/s: median of the rounds (min-max); roofline = B / ((weights + KV bytes per step) / bandwidth)"]
    rows = [["workload", *labels]]
    for b in batches:
        row = [f"decode B={b}"]
        for label in labels:
            m = models[label]
            kv = b * (prompt_len + new_tokens // 2) * kv_bytes_per_token(m.config)      # mean context of the run
            step_bytes = bytes_per_decode_step(m) + kv
            bound = b * bandwidth / step_bytes
            r = results[(f"decode B={b}", label)]
            row.append(f"{r.fmt(1)}, {step_bytes / 2**20:.0f} MiB, {100 * r.median / bound:.0f}%")
        rows.append(row)
    rows += [[f"prefill {n}", *(results[(f"prefill {n}", label)].fmt(1) for label in labels)] for n in prefills]
    lines.append(measure.format_table(rows))
    base = labels[0]
    for label in labels[1:]:
        ratios = [f"{w}: {results[(w, label)].median / results[(w, base)].median:.2f}x"
                  for w in [f"decode B={b}" for b in batches] + [f"prefill {n}" for n in prefills]]
        lines.append(f"{label} vs {base}: " + ", ".join(ratios))
    return "\n".join(lines)


def main(args) -> int:
    """The `speed` subcommand (see __main__.build_parser)."""
    from .backend import describe_kernels, set_backend
    from .weights import load_model

    base = load_model(args.model)
    chosen = [b.strip() for b in args.backends.split(",")]
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    models = {label: set_backend(base, *BACKENDS[label], weights_dir=args.model) for label in chosen}
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    prefills = tuple(int(n) for n in args.prefills.split(",") if n)
    print(f"CPU: {cpu_name()}; {describe_kernels()}; {args.rounds} interleaved rounds; decode: prompt 32, {args.new_tokens} "
          "new tokens")
    bandwidth = measure_bandwidth()
    results = run(models, batches, prefills, args.rounds, args.new_tokens)
    print(format_report(models, results, bandwidth, batches, prefills, new_tokens=args.new_tokens))
    return 0
