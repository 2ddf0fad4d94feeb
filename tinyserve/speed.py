"""`python -m tinyserve speed` (part of `make bench`): tokens/s per backend against the memory-bandwidth roofline.

Lesson 7's question: how close does each backend come to what the hardware allows? For every backend
(fp32-NumPy, int8-Numba = W8A32, W8A8-Numba, W8A8-64-Numba) it measures, in the same run and interleaved round by round (these
machines are shared and noisy; the table shows the median and the min..max of the rounds):
- decode tokens/s at batch B: B requests of a 32-token prompt decoding together through the Engine; only the
  steps where all B decode are timed (prefill excluded);
- prefill tokens/s for a prompt of n tokens: one `kv_cache.prefill` into a fresh cache (time to its last logits).
Next to each decode figure: the bytes one step must read (every weight once + the KV cache of the B sequences),
and the share of the roofline bound B / (bytes / bandwidth) it reached, the bandwidth measured on the spot by
roofline.measure_bandwidth (a float32 matrix-vector product over 256 MiB on BLAS's 2 threads: the access pattern of
streaming weights). An earlier version summed an array in a Numba loop whose 16 running sums lived in an array LLVM
could not keep in registers (it might alias the data): the loop ran scalar and reported ~12 GB/s where BLAS reads
~27, flattering every roofline share by 2x. Measure the measuring instrument too.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from .engine import Engine
from .kv_cache import KVCache, prefill
from .model import Model
from .quant import bytes_per_decode_step
from .roofline import kv_bytes_per_token, measure_bandwidth
from .sampling import SamplingParams

BACKENDS = {"fp32-NumPy": ("none", "numpy"), "int8-Numba": ("int8", "numba"), "W8A8-Numba": ("w8a8", "numba"),
            "W8A8-64-Numba": ("w8a8-64", "numba")}


def cpu_name() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo), to print beside every speed figure."""
    import platform
    if platform.system() == "Linux":
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def decode_tokens_per_s(model: Model, batch: int, prompt_len: int = 32, new_tokens: int = 32, seed: int = 0) -> float:
    """Aggregate decode tokens/s of `batch` sequences decoding together (decode-only steps)."""
    rng = np.random.default_rng(seed)
    engine = Engine(model, num_blocks=batch * ((prompt_len + new_tokens) // 16 + 2), block_size=16,
                    max_batch_tokens=max(256, batch * prompt_len), max_running=batch)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        engine.add_request([int(t) for t in rng.integers(3, model.config.vocab_size, prompt_len)], params)
    engine.run()
    steps = [s for s in engine.stats if s.num_decode == batch and s.num_tokens == batch]
    return batch * len(steps) / sum(s.seconds for s in steps)


def prefill_tokens_per_s(model: Model, n_tokens: int, seed: int = 0) -> float:
    """Tokens/s of one prefill of n_tokens into a fresh KV cache (time to the last position's logits)."""
    ids = [int(t) for t in np.random.default_rng(seed).integers(3, model.config.vocab_size, n_tokens)]
    cache = KVCache.allocate(model.config, n_tokens)
    t0 = time.perf_counter()
    prefill(model, cache, ids)
    return n_tokens / (time.perf_counter() - t0)


@dataclass
class Measurement:
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def __str__(self) -> str:
        return f"{self.median:7.1f} ({min(self.samples):.0f}..{max(self.samples):.0f})"


def run(models: dict[str, Model], batches=(1, 4, 16), prefills=(128, 512, 1024), rounds: int = 3,
        new_tokens: int = 32, progress: bool = True) -> dict[tuple[str, str], Measurement]:
    """Every (workload, backend) pair `rounds` times, interleaved: round r measures all pairs before round r+1."""
    work = [(f"decode B={b}", lambda m, b=b: decode_tokens_per_s(m, b, new_tokens=new_tokens)) for b in batches]
    work += [(f"prefill {n}", lambda m, n=n: prefill_tokens_per_s(m, n)) for n in prefills]
    for m in models.values():                    # warm-up: JIT (or its cache), page in the weights
        decode_tokens_per_s(m, 1, new_tokens=4)
        prefill_tokens_per_s(m, 16)
    results: dict[tuple[str, str], Measurement] = {}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=rounds * len(work) * len(models), desc="speed", unit="run", leave=False)
    for _ in range(rounds):
        for name, fn in work:
            for label, m in models.items():
                results.setdefault((name, label), Measurement()).samples.append(fn(m))
                if bar is not None:
                    bar.update()
    if bar is not None:
        bar.close()
    return results


def format_report(models: dict[str, Model], results, bandwidth: float, batches, prefills, prompt_len: int = 32,
                  new_tokens: int = 32) -> str:
    labels = list(models)
    lines = [f"read bandwidth (2 threads, measured now): {bandwidth / 1e9:.1f} GB/s",
             "tokens/s: median of the rounds (min..max); roofline = B / ((weights + KV bytes per step) / bandwidth)"]
    head = f"{'workload':<14}" + "".join(f"{label:>34}" for label in labels)
    lines += [head, "-" * len(head)]
    for b in batches:
        cells = []
        for label in labels:
            m = models[label]
            kv = b * (prompt_len + new_tokens // 2) * kv_bytes_per_token(m.config)      # mean context of the run
            step_bytes = bytes_per_decode_step(m) + kv
            bound = b * bandwidth / step_bytes
            r = results[(f"decode B={b}", label)]
            cells.append(f"{r} {step_bytes / 2**20:4.0f}MiB {100 * r.median / bound:3.0f}%")
        lines.append(f"{'decode B=' + str(b):<14}" + "".join(f"{c:>34}" for c in cells))
    for n in prefills:
        lines.append(f"{'prefill ' + str(n):<14}" + "".join(f"{str(results[(f'prefill {n}', label)]):>34}"
                                                           for label in labels))
    base = labels[0]
    for label in labels[1:]:
        ratios = [f"{w}: {results[(w, label)].median / results[(w, base)].median:.2f}x"
                  for w in [f"decode B={b}" for b in batches] + [f"prefill {n}" for n in prefills]]
        lines.append(f"{label} vs {base}: " + ", ".join(ratios))
    return "\n".join(lines)


def main(args) -> int:
    """The `speed` subcommand (see __main__.build_parser)."""
    from .quant import set_backend
    from .weights import load_model

    base = load_model(args.weights)
    chosen = [b.strip() for b in args.backends.split(",")]
    unknown = [b for b in chosen if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
    models = {label: set_backend(base, *BACKENDS[label], weights_dir=args.weights) for label in chosen}
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    prefills = tuple(int(n) for n in args.prefills.split(",") if n)
    from .kernels import isa
    print(f"CPU: {cpu_name()}; {isa.describe()}; {args.rounds} interleaved rounds; decode: prompt 32, {args.new_tokens} "
          "new tokens")
    bandwidth = measure_bandwidth()
    results = run(models, batches, prefills, args.rounds, args.new_tokens)
    print(format_report(models, results, bandwidth, batches, prefills, new_tokens=args.new_tokens))
    return 0
