"""Lesson 8: three ways to orchestrate the same Engine under the same arrival trace, measured side by side.

  batched        static batching: take whatever has arrived (up to max_batch), prefill it all, decode it to the
                 end; newcomers wait for the whole batch to finish. Simple, but a request's TTFT includes the rest
                 of the previous batch, and the batch shrinks as requests finish (the GPU/CPU idles).
  interleaved    continuous batching (lesson 4): a newcomer joins at the next step; its prompt is cut into chunks
                 of a per-step token budget so that running decodes keep flowing (chunked prefill).
  disaggregated  a prefill worker process and a decode worker process (DistServe, Splitwise, Mooncake): the
                 prefill worker computes a prompt's K/V and first token, hands the K/V blocks over through shared
                 memory (multiprocessing.shared_memory, the bytes counted), and the decode worker continues from
                 there. Prefill never interrupts decode, at the price of moving K/V and of splitting the machine.

The trace is seeded: the same prompts, lengths and arrival order at every rate (the unit-rate gaps are scaled by
1/rate), so the designs and the rates differ only in what they are meant to differ in. All times are
time.monotonic() (CLOCK_MONOTONIC on Linux: one clock for all processes).

The hand-over uses only the Engine's public interface: `export_kv` reads a running sequence's prompt K/V out of
the pool (engine.pool, seq.block_table), and `adopt_prefilled` (Engine.add_prefilled) creates a running sequence in
another engine whose prompt is already computed.
"""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from .engine import Engine
from .kv_sizing import blocks_for
from .sampling import SamplingParams
from .sequence import Sequence

# --- the workload ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival: float            # seconds after the start of the run
    prompt: list[int]
    max_tokens: int           # exactly this many tokens are generated (EOS is ignored: every run does the same work)


def poisson_trace(rate: float, num_requests: int, prompt_len: tuple[int, int] = (32, 256),
                  output_len: tuple[int, int] = (16, 96), vocab_size: int = 49152, seed: int = 0
                  ) -> list[TraceRequest]:
    """Poisson arrivals at `rate` requests/s; prompt and output lengths uniform in the given inclusive ranges.

    The same seed gives the same requests in the same order at every rate; only the gaps are scaled."""
    if rate <= 0 or num_requests < 1:
        raise ValueError(f"need rate > 0 and num_requests >= 1, got {rate}, {num_requests}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, num_requests) / rate
    gaps[0] = 0.0                                    # the first request opens the run
    arrivals = np.cumsum(gaps)
    out = []
    for t in arrivals:
        n_prompt = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        n_out = int(rng.integers(output_len[0], output_len[1] + 1))
        out.append(TraceRequest(float(t), [int(x) for x in rng.integers(3, vocab_size, n_prompt)], n_out))
    return out


def greedy_params(req: TraceRequest) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=req.max_tokens, ignore_eos=True)


# --- what a run measures --------------------------------------------------------------------------------------


@dataclass(slots=True)
class Timing:
    arrival: float                                      # absolute (monotonic) time the request arrived
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class DesignResult:
    design: str
    rate: float
    timings: list[Timing]
    seconds: float                                      # first arrival -> last token
    kv_bytes_moved: int = 0                             # disaggregated only: K/V bytes through shared memory

    @property
    def ttft(self) -> np.ndarray:                       # [num_requests] s
        return np.array([t.token_times[0] - t.arrival for t in self.timings])

    @property
    def itl(self) -> np.ndarray:                        # [all gaps] s
        return np.concatenate([np.diff(t.token_times) for t in self.timings])

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t.tokens) for t in self.timings) / self.seconds

    @property
    def offered_tokens_per_s(self) -> float:
        """What the trace asks for: the arrival rate times the mean output length. A server that keeps up delivers
        this (tokens_per_s, less the ramp at both ends of a finite trace); one past its capacity delivers less."""
        return self.rate * sum(len(t.tokens) for t in self.timings) / len(self.timings)

    def row(self) -> dict:
        p = lambda a, q: float(np.percentile(a, q) * 1e3) if len(a) else float("nan")  # noqa: E731
        ttft, itl = self.ttft, self.itl
        return {"design": self.design, "rate": self.rate, "ttft_p50_ms": p(ttft, 50), "ttft_p90_ms": p(ttft, 90),
                "ttft_p99_ms": p(ttft, 99), "itl_p50_ms": p(itl, 50), "itl_p90_ms": p(itl, 90),
                "itl_p99_ms": p(itl, 99), "itl_mean_ms": float(itl.mean() * 1e3) if len(itl) else float("nan"),
                "offered_tokens_per_s": self.offered_tokens_per_s, "tokens_per_s": self.tokens_per_s,
                "seconds": self.seconds, "kv_mb_moved": self.kv_bytes_moved / 2**20}


# --- batched and interleaved: one engine, one process -----------------------------------------------------------


def _drive(engine: Engine, trace: list[TraceRequest], design: str, rate: float, max_batch: int | None) -> DesignResult:
    """Replay `trace` in real time against `engine`. max_batch=None: every arrival joins at the next step
    (interleaved); an int: arrivals are admitted only when the engine is empty, at most max_batch at once."""
    t0 = time.monotonic()
    pending = deque(enumerate(trace))
    timings = [Timing(t0 + r.arrival) for r in trace]
    rid_to_i: dict[int, int] = {}
    while pending or engine.has_unfinished():
        now = time.monotonic() - t0
        if max_batch is None or not engine.has_unfinished():
            admitted = 0
            while pending and pending[0][1].arrival <= now and (max_batch is None or admitted < max_batch):
                i, req = pending.popleft()
                rid_to_i[engine.add_request(req.prompt, greedy_params(req))] = i
                admitted += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][1].arrival - (time.monotonic() - t0)))   # idle until the next arrival
            continue
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            t = timings[rid_to_i[out.request_id]]
            t.token_times.extend([now] * len(out.new_tokens))
            t.tokens.extend(out.new_tokens)
            if out.finished:
                engine.pop_finished(out.request_id)
    return DesignResult(design, rate, timings, max(t.token_times[-1] for t in timings) - t0)


def run_batched(model, trace: list[TraceRequest], rate: float = 0.0, max_batch: int = 8, num_blocks: int = 256,
                block_size: int = 16, **engine_kw) -> DesignResult:
    """Static batching: prefill the whole batch in one step (the token budget fits every prompt), then decode."""
    budget = max_batch * max(len(r.prompt) for r in trace)
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=budget,
                    max_running=max_batch, **engine_kw)
    return _drive(engine, trace, "batched", rate, max_batch)


def run_interleaved(model, trace: list[TraceRequest], rate: float = 0.0, token_budget: int = 64,
                    max_running: int = 32, num_blocks: int = 256, block_size: int = 16, **engine_kw) -> DesignResult:
    """Continuous batching with chunked prefill: at most `token_budget` tokens per step, decodes first."""
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, max_batch_tokens=token_budget,
                    max_running=max_running, **engine_kw)
    return _drive(engine, trace, "interleaved", rate, None)


# --- the K/V hand-over ------------------------------------------------------------------------------------------


def export_kv(engine: Engine, seq: Sequence, num_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """The K/V of positions 0 .. num_positions-1 of a sequence, gathered from its blocks: two [L, P, K, H]."""
    assert seq.num_computed_tokens >= num_positions, "only computed positions have K/V"
    if engine.local_pool is not None:   # lesson 11: the local layers' K/V are in a pool of their own, partly freed
        return engine.kv.read_prompt(seq.block_table, seq.local_table, num_positions)
    bs = engine.block_size
    table = np.asarray(seq.block_table[:blocks_for(num_positions, bs)], dtype=np.int64)
    L, _, _, K, H = engine.pool.k.shape
    k = engine.pool.k[:, table].reshape(L, -1, K, H)[:, :num_positions]             # [L, P, K, H]
    v = engine.pool.v[:, table].reshape(L, -1, K, H)[:, :num_positions]
    return k, v


def adopt_prefilled(engine: Engine, prompt: list[int], params: SamplingParams, first_token: int,
                    k: np.ndarray, v: np.ndarray, rng_state: dict | None = None,
                    first_token_time: float | None = None) -> int:
    """Engine.add_prefilled under the name lesson 8 and its tests use: `engine` continues a request whose prompt
    K/V (k, v: [L, P, K, H]) and first token another engine computed. Returns the engine's request id."""
    return engine.add_prefilled(prompt, params, first_token, k, v, rng_state, first_token_time)


# --- disaggregated: two worker processes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How a worker process gets the model (a model object is not sent between processes: each one loads)."""
    kind: str = "tiny"                 # "tiny" | "smollm2"
    weights: str | None = None
    quant: str | None = None           # passed to load_model only when given (e.g. "int8")
    backend: str | None = None         # the same (e.g. "numba": the fused kernels of lesson 7)

    def load(self):
        from .weights import load_model, tiny_model
        if self.kind == "tiny":
            return tiny_model(seed=0)
        kw = {k: v for k, v in (("quant", self.quant), ("backend", self.backend)) if v}
        return load_model(self.weights, **kw) if self.weights else load_model(**kw)


def _worker_setup(blas_threads: int | None):
    if blas_threads:
        from threadpoolctl import threadpool_limits
        return threadpool_limits(blas_threads)
    return None


def _prefill_worker(spec: ModelSpec, engine_kw: dict, inbox, handover, results, ready, blas_threads) -> None:
    from multiprocessing import shared_memory
    limit = _worker_setup(blas_threads)  # noqa: F841  (kept alive for the life of the worker)
    engine = Engine(spec.load(), **engine_kw)
    ready.put("prefill")
    meta: dict[int, tuple[int, float, TraceRequest]] = {}     # engine rid -> (trace index, arrival, request)
    done = False
    while not done or engine.has_unfinished():
        while True:                    # take every request that has arrived; block only when there is no work
            try:
                msg = inbox.get(block=not engine.has_unfinished() and not done, timeout=None)
            except queue_mod.Empty:
                break
            if msg is None:
                done = True
                break
            i, arrival, req = msg
            meta[engine.add_request(req.prompt, greedy_params(req))] = (i, arrival, req)
        if not engine.has_unfinished():
            continue
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:            # each output here is a first token: prefill ends when it is sampled
            i, arrival, req = meta.pop(out.request_id)
            token = out.new_tokens[0]
            if out.finished:           # one-token request: nothing to hand over
                engine.pop_finished(out.request_id)
                results.put((i, [now], [token], 0))
                continue
            seq = engine.sequence(out.request_id)
            P = len(req.prompt)
            k, v = export_kv(engine, seq, P)
            shm = shared_memory.SharedMemory(create=True, size=k.nbytes + v.nbytes)
            buf = np.ndarray((2, *k.shape), dtype=k.dtype, buffer=shm.buf)           # [2, L, P, K, H]
            buf[0], buf[1] = k, v
            rng_state = seq.rng.bit_generator.state
            del buf
            shm.close()
            engine.abort(out.request_id)               # its blocks are free for the next prompt at once
            engine.pop_finished(out.request_id)
            handover.put((i, req, token, now, rng_state, shm.name, k.shape, str(k.dtype)))
    handover.put(None)


def _decode_worker(spec: ModelSpec, engine_kw: dict, handover, results, ready, blas_threads) -> None:
    from multiprocessing import shared_memory
    limit = _worker_setup(blas_threads)  # noqa: F841
    engine = Engine(spec.load(), **engine_kw)
    ready.put("decode")
    waiting: deque = deque()
    meta: dict[int, tuple[int, list[float], list[int]]] = {}
    done = False
    moved = 0
    while not done or waiting or engine.has_unfinished():
        while True:
            try:
                msg = handover.get(block=not engine.has_unfinished() and not waiting and not done)
            except queue_mod.Empty:
                break
            if msg is None:
                done = True
                break
            waiting.append(msg)
        # adopt hand-overs in arrival order while the pool has room (FCFS; the rest wait in shared memory)
        while waiting:
            i, req, token, t_first, rng_state, name, shape, dtype = waiting[0]
            if engine.blocks.num_free < blocks_for(len(req.prompt) + 1, engine.block_size):
                break
            waiting.popleft()
            shm = shared_memory.SharedMemory(name=name)
            buf = np.ndarray((2, *shape), dtype=dtype, buffer=shm.buf)
            rid = adopt_prefilled(engine, req.prompt, greedy_params(req), token, buf[0], buf[1], rng_state)
            moved += buf.nbytes
            del buf
            shm.close()
            shm.unlink()
            meta[rid] = (i, [t_first], [token])
        if not engine.has_unfinished():
            continue
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            i, times, tokens = meta[out.request_id]
            times.extend([now] * len(out.new_tokens))
            tokens.extend(out.new_tokens)
            if out.finished:
                engine.pop_finished(out.request_id)
                del meta[out.request_id]
                results.put((i, times, tokens, 0))
    results.put(("moved", moved))


def run_disaggregated(spec: ModelSpec, trace: list[TraceRequest], rate: float = 0.0, token_budget: int = 256,
                      num_blocks: int = 256, block_size: int = 16, max_running: int = 32,
                      blas_threads: int | None = 1, timeout: float = 600.0, **engine_kw) -> DesignResult:
    """A prefill process and a decode process (one BLAS thread each by default: each owns one core of two).
    The prefill engine runs whole prompts (budget `token_budget`); the decode engine only ever decodes."""
    ctx = mp.get_context("spawn")       # fork would copy this process's BLAS/numba thread pools mid-flight
    inbox, handover, results, ready = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    pre_kw = dict(num_blocks=num_blocks, block_size=block_size, max_batch_tokens=token_budget,
                  max_running=max_running, **engine_kw)
    dec_kw = dict(num_blocks=num_blocks, block_size=block_size, max_batch_tokens=max_running,
                  max_running=max_running, **engine_kw)
    procs = [ctx.Process(target=_prefill_worker, args=(spec, pre_kw, inbox, handover, results, ready, blas_threads),
                         daemon=True),
             ctx.Process(target=_decode_worker, args=(spec, dec_kw, handover, results, ready, blas_threads),
                         daemon=True)]
    for p in procs:
        p.start()
    def get(q):                          # a queue read that notices a worker which died (its traceback is above)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return q.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"disaggregated run: {dead[0].name} exited with code {dead[0].exitcode}"
                                       if dead else f"disaggregated run: no answer in {timeout} s") from None

    try:
        for _ in procs:                  # both models loaded before the clock starts
            get(ready)
        t0 = time.monotonic()
        timings = [Timing(t0 + r.arrival) for r in trace]
        for i, req in enumerate(trace):
            delay = t0 + req.arrival - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            inbox.put((i, t0 + req.arrival, req))
        inbox.put(None)
        moved = None
        pending = len(trace)
        while pending or moved is None:
            msg = get(results)
            if msg[0] == "moved":
                moved = msg[1]
                continue
            i, times, tokens, _ = msg
            timings[i].token_times, timings[i].tokens = times, tokens
            pending -= 1
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return DesignResult("disaggregated", rate, timings, max(t.token_times[-1] for t in timings) - t0, moved)


# --- the comparison -------------------------------------------------------------------------------------------


def compare_designs(spec: ModelSpec, rates: list[float], num_requests: int = 24,
                    prompt_len: tuple[int, int] = (16, 128), output_len: tuple[int, int] = (8, 48), seed: int = 0,
                    max_batch: int = 8, token_budget: int = 64, engine_kw: dict | None = None,
                    progress=None) -> list[dict]:
    """Every design at every rate on the same trace; one row (DesignResult.row) per run. The batched and
    interleaved designs run in this process (the BLAS threads as configured); the disaggregated one in two
    processes with one BLAS thread each. Runs are interleaved by rate, so slow drift of a shared machine hits all
    three designs alike. max_batch bounds the running requests of every design alike (a static batch's size, the
    others' max_running), so one prediction with that limit speaks for all three."""
    engine_kw = engine_kw or {}
    model = spec.load()
    rows = []
    for rate in rates:
        trace = poisson_trace(rate, num_requests, prompt_len, output_len, model.config.vocab_size, seed)
        for result in (run_batched(model, trace, rate, max_batch=max_batch, **engine_kw),
                       run_interleaved(model, trace, rate, token_budget=token_budget, max_running=max_batch,
                                       **engine_kw),
                       run_disaggregated(spec, trace, rate, token_budget=max(token_budget, prompt_len[1]),
                                         max_running=max_batch, **engine_kw)):
            rows.append(result.row())
            if progress is not None:
                progress(format_rows(rows[-1:], header=len(rows) == 1))
    return rows


def format_rows(rows: list[dict], header: bool = True) -> str:
    cols = ["design", "rate", "ttft_p50_ms", "ttft_p90_ms", "itl_p50_ms", "itl_p90_ms", "offered_tokens_per_s",
            "tokens_per_s", "kv_mb_moved"]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    names = {"offered_tokens_per_s": "offered_tok/s", "tokens_per_s": "delivered_tok/s"}
    lines = ["  ".join(f"{names.get(c, c):>15}" for c in cols)] if header else []
    lines += ["  ".join(f"{fmt(r[c]):>15}" for c in cols) for r in rows]
    return "\n".join(lines)
