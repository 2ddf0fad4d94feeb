"""How long does one big request stall a stream beside it? (docs/serving.md, "The event loop").

Starts `python -m tinyserve serve` as a user would, opens one long greedy stream, and once it flows posts a big
body beside it; records the gaps between the stream's chunks and the latency of /health pinged every 20 ms.
The stall is the largest chunk gap while the big request is in, minus the stream's own largest gap before it.

On a busy machine those wall-clock gaps are mostly other processes' doing, so --loop-cpu measures what the
event loop itself spends instead: the server runs in this process, and every callback the loop runs is timed in
CPU seconds of the loop's thread (time.thread_time); the longest one while the big request is in is the stall it
causes on an idle machine.

    python tools/serve_stall.py --model smollm2 --sizes 50e6 --max-body-size 67108864
    python tools/serve_stall.py --root /tmp/old-tinyserve ...      # the same probe against another checkout
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(root: Path, model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = ["--model", "tiny", "--quant", "none", "--backend", "numpy"] if model == "tiny" else ["--compile", "wait"]
    proc = subprocess.Popen([sys.executable, "-m", "tinyserve", "serve", *args, "--port", str(port), *extra],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 600:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read()}")
        time.sleep(0.2)
    raise SystemExit("the server did not come up")


def probe(url: str, name: str, size: int, max_tokens: int) -> dict:
    chunks: list[float] = []
    pings: list[tuple[float, float]] = []
    stop = threading.Event()

    def stream() -> None:
        body = {"model": name, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(time.perf_counter())

    def ping() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            httpx.get(url + "/health", timeout=60)
            pings.append((t, time.perf_counter() - t))
            time.sleep(0.02)

    streamer, pinger = threading.Thread(target=stream), threading.Thread(target=ping)
    streamer.start()
    while len(chunks) < 50:                      # the stream flows
        time.sleep(0.01)
    pinger.start()
    time.sleep(0.5)
    prompt = "hello world " * (size // 12)
    raw = json.dumps({"model": name, "prompt": prompt, "max_tokens": 1}).encode()
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"}, timeout=600)
    t1 = time.perf_counter()
    time.sleep(0.3)
    stop.set()
    pinger.join()
    streamer.join()
    gaps_before = [b - a for a, b in zip(chunks, chunks[1:]) if b < t0]
    gaps_during = [b - a for a, b in zip(chunks, chunks[1:]) if b >= t0 and a <= t1 + 0.05]
    return {"body_mb": round(len(raw) / 1e6, 1), "status": r.status_code,
            "code": (r.json().get("error") or {}).get("code") if r.headers.get("content-type", "").startswith(
                "application/json") else None,
            "answer_s": round(t1 - t0, 3),
            "stream_max_gap_before_ms": round(1e3 * max(gaps_before), 1),
            "stream_max_gap_during_ms": round(1e3 * max(gaps_during, default=0.0), 1),
            "health_max_ms_during": round(1e3 * max((d for t, d in pings if t0 <= t <= t1), default=0.0), 1),
            "stream_chunks_during": len(gaps_during)}


def loop_cpu(root: Path, sizes: list[int], max_body_size: int | None) -> None:
    """The longest event-loop callback (CPU ms of the loop thread) while each big body is handled, in process."""
    sys.path.insert(0, str(root))
    import asyncio.events
    import inspect
    from tinyserve import server
    from tinyserve.__main__ import build_parser

    longest: list[float] = [0.0]
    run = asyncio.events.Handle._run

    def timed(self):
        if threading.current_thread().name != "tinyserve-http":
            return run(self)
        t = time.thread_time()
        try:
            return run(self)
        finally:
            longest[0] = max(longest[0], time.thread_time() - t)
    asyncio.events.Handle._run = timed

    extra = ["--max-body-size", str(max_body_size)] if max_body_size else []
    args = build_parser().parse_args(["serve", "--model", "tiny", "--quant", "none", "--backend", "numpy", *extra])
    app, name = server.build(args)
    kwargs = {"drain_timeout": 5} if "drain_timeout" in inspect.signature(server.ServerThread).parameters else {}
    with server.ServerThread(app, **kwargs) as srv:
        for size in sizes:
            raw = json.dumps({"model": name, "prompt": "hello world " * (size // 12), "max_tokens": 1}).encode()
            httpx.get(srv.url + "/health")
            longest[0] = 0.0
            r = httpx.post(srv.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                           timeout=600)
            time.sleep(1.0)           # the callback that sent the answer may still be running: let it end
            print(json.dumps({"root": str(root), "max_body_size": max_body_size, "body_mb": round(len(raw) / 1e6, 1),
                              "status": r.status_code, "longest_loop_callback_cpu_ms": round(longest[0] * 1e3, 1)}),
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the checkout to serve from")
    ap.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    ap.add_argument("--sizes", default="5e6,50e6", help="body sizes in bytes, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--loop-cpu", action="store_true", help="in process, tiny model: the loop's longest callback")
    ap.add_argument("--max-body-size", type=int, default=None, help="with --loop-cpu")
    ap.add_argument("server_args", nargs="*", help="passed to serve (after --), e.g. -- --max-body-size 67108864")
    args = ap.parse_args()
    if args.loop_cpu:
        return loop_cpu(Path(args.root), [int(float(s)) for s in args.sizes.split(",")], args.max_body_size)
    proc, url = start(Path(args.root), args.model, args.server_args)
    name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    try:
        for size in (int(float(s)) for s in args.sizes.split(",")):
            print(json.dumps({"server_args": args.server_args, **probe(url, name, size, args.max_tokens)}),
                  flush=True)
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
