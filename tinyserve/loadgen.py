"""Lesson 8: a load generator for a running server — many concurrent streaming clients over plain HTTP (httpx).

Each request is POST /v1/completions with stream=true, its prompt given as token ids (so the same workload as
`bench` runs unchanged), measured at the client: TTFT = send -> first SSE chunk, ITL = the gaps between chunks.
Arrivals are either closed-loop (at most `concurrency` in flight, the next one sent as soon as one ends) or
open-loop Poisson at `rate` requests/s (still capped at `concurrency` connections). Some clients may hang up
mid-stream on purpose (`disconnect_after`), which is how the tests check that the server cancels them.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np

from .protocol import parse_sse


@dataclass(slots=True)
class ClientRequest:
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = True
    disconnect_after: int | None = None     # hang up after this many chunks (None: read to the end)


@dataclass(slots=True)
class ClientResult:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None    # from the final usage chunk
    sent: float = 0.0
    ended: float = 0.0                      # the stream's end ([DONE] or the connection closing)
    chunk_times: list[float] = field(default_factory=list)
    cancelled: bool = False                 # this client hung up on purpose
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.ended - self.sent if self.ended else None

    @property
    def itl(self) -> list[float]:
        return list(np.diff(self.chunk_times)) if len(self.chunk_times) > 1 else []


@dataclass(slots=True)
class LoadReport:
    results: list[ClientResult]
    seconds: float

    @property
    def completed(self) -> list[ClientResult]:
        return [r for r in self.results if r.status == 200 and r.finish_reason and not r.cancelled]

    def summary(self) -> dict:
        done = self.completed
        ttft = np.array([r.ttft for r in done if r.ttft is not None])
        itl = np.array([d for r in done for d in r.itl])
        q = lambda a, p: float(np.percentile(a, p) * 1e3) if len(a) else float("nan")  # noqa: E731
        return {"requests": len(self.results), "completed": len(done),
                "cancelled": sum(r.cancelled for r in self.results),
                "rejected_429": sum(r.status == 429 for r in self.results),
                "errors": sum(1 for r in self.results if not r.cancelled and (r.status != 200 or r.error)
                              and r.status != 429),
                "seconds": self.seconds, "requests_per_s": len(done) / self.seconds,
                "output_tokens_per_s": sum(r.completion_tokens or 0 for r in done) / self.seconds,
                "ttft_p50_ms": q(ttft, 50), "ttft_p99_ms": q(ttft, 99), "itl_p50_ms": q(itl, 50),
                "itl_p99_ms": q(itl, 99)}


async def _one(client, url: str, model: str, req: ClientRequest) -> ClientResult:
    res = ClientResult(sent=time.perf_counter())
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": req.temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": req.ignore_eos}
    if req.seed is not None:
        body["seed"] = req.seed
    pieces = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode(errors="replace")
                return res
            async for event in _events(resp):
                if event == "[DONE]":
                    break
                if "error" in event:
                    res.error = json.dumps(event["error"])
                    break
                if event.get("usage"):
                    res.completion_tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or ():   # a usage-only chunk may carry none
                    if choice["text"]:   # the closing chunk (finish_reason, no text) is not a token's arrival
                        res.chunk_times.append(time.perf_counter())
                    pieces.append(choice["text"])
                    res.finish_reason = choice["finish_reason"] or res.finish_reason
                if req.disconnect_after is not None and len(res.chunk_times) >= req.disconnect_after:
                    res.cancelled = True
                    break          # leaving the block closes the connection: the server must notice
    except Exception as e:         # a client-side failure is a result to report, not a crash of the run
        res.error = f"{type(e).__name__}: {e}"
    res.ended = time.perf_counter()
    res.text = "".join(pieces)
    return res


async def _events(resp):
    async for line in resp.aiter_lines():
        for event in parse_sse([line]):
            yield event


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> np.ndarray:
    """[n] send times in s for Poisson arrivals at `rate` requests/s: exponential gaps, the first request at 0."""
    if n < 1 or not rate > 0:
        raise ValueError(f"want n >= 1 requests at a rate > 0 per s, got n={n}, rate={rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.cumsum(gaps) - gaps[0]


async def run_load(url: str, model: str, requests: list[ClientRequest], concurrency: int = 32,
                   rate: float | None = None, seed: int = 0, timeout: float = 600.0) -> LoadReport:
    """Send every request; return what each client saw. rate=None: closed loop; else Poisson arrivals."""
    starts = poisson_arrivals(len(requests), rate, seed) if rate else np.zeros(len(requests))
    return await run_arrivals(url, model, requests, starts, concurrency=concurrency, timeout=timeout)


async def run_arrivals(url: str, model: str, requests: list[ClientRequest], starts, concurrency: int = 32,
                       timeout: float = 600.0) -> LoadReport:
    """Send request i at starts[i] s after the start (at most `concurrency` in flight); what each client saw."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()

        async def go(i: int, req: ClientRequest) -> ClientResult:
            delay = t0 + starts[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with sem:
                return await _one(client, url, model, req)

        results = await asyncio.gather(*(go(i, r) for i, r in enumerate(requests)))
        return LoadReport(list(results), time.perf_counter() - t0)


def drive(url: str, model: str, requests: list[ClientRequest], **kw) -> LoadReport:
    """run_load from synchronous code (a script, a test, a notebook cell with a running loop uses a thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load(url, model, requests, **kw))
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(1) as pool:      # Jupyter already runs an event loop
        return pool.submit(asyncio.run, run_load(url, model, requests, **kw)).result()
