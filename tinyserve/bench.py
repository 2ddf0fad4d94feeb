"""`python -m tinyserve bench`: a reproducible batch workload through the Engine, and a batch-size sweep.

The workload is N requests with prompt and output lengths drawn uniformly from given ranges (seeded); prompts are
random token ids and EOS is ignored, so every request produces exactly its drawn number of tokens and two runs do
the same work. All requests arrive at once (an offline batch): TTFT therefore includes queueing behind the
others, which is what a user of a busy server sees.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from . import measure
from .backend import runs_on_kernels
from .engine import Engine
from .model import Model
from .sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int = 16
    prompt_len: tuple[int, int] = (32, 256)    # inclusive range, uniform
    output_len: tuple[int, int] = (16, 96)
    seed: int = 0
    shared_prefix: int = 0                     # tokens every prompt starts with (lesson 5: a system prompt)

    def requests(self, vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
        for name, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} range must satisfy 1 <= lo <= hi, got {lo}:{hi}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.shared_prefix < 0:
            raise ValueError(f"shared_prefix must be >= 0, got {self.shared_prefix}")
        # drawn from a stream of its own, so the rest of the workload is the same with or without it
        prefix = [int(t) for t in np.random.default_rng(self.seed + 1).integers(3, vocab_size, self.shared_prefix)]
        rng = np.random.default_rng(self.seed)
        out = []
        for _ in range(self.num_requests):
            n_prompt = int(rng.integers(self.prompt_len[0], self.prompt_len[1] + 1))
            n_out = int(rng.integers(self.output_len[0], self.output_len[1] + 1))
            prompt = prefix + [int(t) for t in rng.integers(3, vocab_size, size=n_prompt)]
            out.append((prompt, SamplingParams(temperature=0, max_new_tokens=n_out, ignore_eos=True)))
        return out


@dataclass(frozen=True, slots=True)
class BenchResult:
    label: str
    num_requests: int
    output_tokens: int
    seconds: float
    ttft: np.ndarray          # [num_requests] s
    itl: np.ndarray           # [all inter-token gaps] s
    peak_blocks: int
    num_blocks: int
    preemptions: int
    mean_batch: float         # sequences per step

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def row(self) -> dict[str, str]:
        p = lambda a, q: f"{np.percentile(a, q) * 1e3:.0f}" if len(a) else "-"  # noqa: E731
        return {"run": self.label, "req/s": f"{self.requests_per_s:.2f}", "out tok/s": f"{self.tokens_per_s:.1f}",
                "TTFT p50 ms": p(self.ttft, 50), "TTFT p90 ms": p(self.ttft, 90),
                "ITL p50 ms": p(self.itl, 50), "ITL p90 ms": p(self.itl, 90),
                "peak blocks": f"{self.peak_blocks}/{self.num_blocks}", "preempt": str(self.preemptions),
                "batch": f"{self.mean_batch:.1f}"}


def run_workload(model: Model, requests: list[tuple[list[int], SamplingParams]], label: str = "engine",
                 progress: bool = True, **engine_kwargs) -> BenchResult:
    """Serve `requests` (all arriving now) with a fresh Engine(model, **engine_kwargs); measure it."""
    engine = Engine(model, **engine_kwargs)
    total = sum(p.max_new_tokens for _, p in requests)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=label, unit="tok", leave=False)
    t0 = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    engine.run(progress=(lambda outs: bar.update(len(outs))) if bar is not None else None)
    seconds = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    metrics = [engine.finished[i].metrics() for i in ids]
    stats = engine.stats
    return BenchResult(label, len(ids), sum(m.num_output_tokens for m in metrics), seconds,
                       np.array([m.ttft for m in metrics]), np.array([d for m in metrics for d in m.itl]),
                       engine.peak_blocks_used, engine.blocks.num_blocks,
                       sum(s.num_preempted for s in stats), float(np.mean([s.num_seqs for s in stats])))


def batch_sweep(model: Model, batch_sizes=(1, 4, 16), prompt_len: int = 32, new_tokens: int = 32,
                progress: bool = True, **engine_kwargs) -> list[BenchResult]:
    """Aggregate decode throughput at fixed batch sizes: B identical-length requests at once, B = each size.
    The same prompt lengths and output lengths at every B, so the ratios say what batching buys."""
    results = []
    for b in batch_sizes:
        w = Workload(num_requests=b, prompt_len=(prompt_len, prompt_len), output_len=(new_tokens, new_tokens),
                     seed=b)
        # the batch size is what the sweep varies: it overrides a max_running given with the other options
        results.append(run_workload(model, w.requests(model.config.vocab_size), label=f"batch {b}",
                                    progress=progress, **(engine_kwargs | {"max_running": b})))
    return results


def format_table(results: list[BenchResult]) -> str:
    """One row per run (BenchResult.row), aligned (measure.format_table)."""
    rows = [r.row() for r in results]
    return measure.format_table([list(rows[0]), *(list(r.values()) for r in rows)])


def main(args) -> int:
    """The `bench` subcommand (see __main__.build_parser); with --server, the same workload against a server."""
    if args.server:      # lesson 8
        return run_server(args)
    from .cli_options import is_tiny
    from .backend import set_backend
    from .weights import load_model, tiny_model

    model = (set_backend(tiny_model(seed=0), args.quant, args.backend) if is_tiny(args)
             else load_model(args.model, quant=args.quant, backend=args.backend))
    if runs_on_kernels(model):   # lesson 7: compile (announced) before anything is timed
        from . import jit
        _, kernels = jit.prepare(model, "engine", background=False, log=print)
        print(f"kernels: {'loaded from the on-disk cache' if kernels.how == 'cache' else 'compiled'} in "
              f"{kernels.seconds:.1f} s (not timed)")
    parse = lambda s: tuple(int(x) for x in s.split(":")) * (1 if ":" in s else 2)  # noqa: E731  "a:b" or "a"
    workload = Workload(args.requests, parse(args.prompt_len), parse(args.output_len), args.seed,
                        getattr(args, "shared_prefix", 0))
    from .cli_options import engine_kwargs
    kw = engine_kwargs(args, model)   # the pool, the token budget and (lesson 6) --speculative
    print(f"workload: {workload.num_requests} requests, prompt {workload.prompt_len[0]}..{workload.prompt_len[1]} "
          f"tokens (after a shared prefix of {workload.shared_prefix}), output {workload.output_len[0]}.."
          f"{workload.output_len[1]} tokens, seed {workload.seed}; "
          f"model {args.model} ({model.quant}, {model.backend} backend); engine {kw}")
    results = [run_workload(model, workload.requests(model.config.vocab_size), label="workload", **kw)]
    if workload.shared_prefix:   # lesson 5: the same requests again, with the prefix trie on
        results.append(run_workload(model, workload.requests(model.config.vocab_size), label="+ prefix trie",
                                    prefix_caching=True, **kw))
        print(f"shared prefix of {workload.shared_prefix} tokens: TTFT p50 "
              f"{np.median(results[0].ttft) / np.median(results[1].ttft):.1f}x lower and "
              f"{results[1].tokens_per_s / results[0].tokens_per_s:.2f}x output tokens/s with the prefix trie")
    sweep = []
    if args.sweep:
        sizes = tuple(int(b) for b in args.sweep.split(","))
        sweep = batch_sweep(model, sizes, prompt_len=32, new_tokens=32, **kw)
    print(format_table(results + sweep))
    if sweep:
        base = sweep[0]
        print(f"aggregate output tokens/s vs batch {base.num_requests} (prompt 32, 32 new tokens each, prefill "
              "included): " + ", ".join(f"B={r.num_requests}: {r.tokens_per_s / base.tokens_per_s:.2f}x"
                                        for r in sweep))
        # decode steps alone: B tokens per step, a step lasting the median inter-token latency
        print("decode steps alone (B / median ITL): " + ", ".join(
            f"B={r.num_requests}: {r.num_requests / np.median(r.itl):.1f} tokens/s" for r in sweep))
    return 0


def run_server(args) -> int:
    """`bench --server URL`: the same workload against a running server (lesson 8), as concurrent streaming
    clients over HTTP; TTFT and ITL are measured at the client. --rate R sends Poisson arrivals at R requests/s
    (else: closed loop, --concurrency in flight); --hangup-every N makes every Nth client hang up after 2 chunks."""
    import httpx

    from .loadgen import ClientRequest, drive

    url = args.server.rstrip("/")
    info = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
    parse = lambda s: tuple(int(x) for x in s.split(":")) * (1 if ":" in s else 2)  # noqa: E731
    workload = Workload(args.requests, parse(args.prompt_len), parse(args.output_len), args.seed)
    every = args.hangup_every
    reqs = [ClientRequest(prompt, p.max_new_tokens, disconnect_after=2 if every and i % every == every - 1 else None)
            for i, (prompt, p) in enumerate(workload.requests(info["vocab_size"]))]
    print(f"server {url} ({info['id']}): {len(reqs)} requests, prompt {workload.prompt_len[0]}..{workload.prompt_len[1]}"
          f" tokens, output {workload.output_len[0]}..{workload.output_len[1]}, concurrency {args.concurrency}, "
          f"{'rate %.2f/s' % args.rate if args.rate else 'closed loop'}, hang-up every {every or '-'}")
    report = drive(url, info["id"], reqs, concurrency=args.concurrency, rate=args.rate, seed=args.seed)
    s = report.summary()
    for _ in range(300):     # hang-ups are aborted at the server's next step boundary: let it settle (<= 30 s)
        health = httpx.get(url + "/health", timeout=30).json()
        if health["running"] == 0 and health["waiting"] == 0:
            break
        time.sleep(0.1)
    print(f"{s['completed']} completed, {s['cancelled']} cancelled by their client, {s['rejected_429']} rejected (429), "
          f"{s['errors']} errors in {s['seconds']:.1f} s: {s['requests_per_s']:.2f} requests/s, "
          f"{s['output_tokens_per_s']:.1f} output tokens/s")
    print(f"TTFT p50 {s['ttft_p50_ms']:.0f} ms, p99 {s['ttft_p99_ms']:.0f} ms; ITL p50 {s['itl_p50_ms']:.0f} ms, "
          f"p99 {s['itl_p99_ms']:.0f} ms (client side)")
    print(f"server after the run: {health['kv_blocks_used']} KV blocks held by requests, {health['running']} running, "
          f"{health['waiting']} waiting; {health['aborted']} aborted so far")
    return 1 if s["errors"] else 0
