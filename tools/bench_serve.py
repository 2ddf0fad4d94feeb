"""`make bench-serve`: `tinyserve serve` and llama.cpp's `llama-server` under the same offered load, side by side.

    .venv/bin/python tools/bench_serve.py                    # the full sweep (~10 min), recorded in docs/bench-serve.md
    .venv/bin/python tools/bench_serve.py --quick            # 2 rates, 10 s each: checks the whole chain end to end
    .venv/bin/python tools/bench_serve.py --rates 1,2,4 --seconds 20
    .venv/bin/python tools/bench_serve.py --table            # regenerate docs/bench-serve.md from the recorded runs

The client is guidellm (PyPI, in .venv-guidellm: `make bench-serve` installs it), one `guidellm run` per server and
rate: a Poisson profile at that rate, max(--min-requests, rate x --seconds) streaming POST /v1/completions with
synthetic text prompts made with SmolLM2's tokenizer and a fixed number of output tokens each (`max_tokens` with
`ignore_eos`), seeded, so both servers get the same prompts at the same offsets. The length mix is `tinyserve
bench`'s (prompts of 32-256 tokens, outputs of 16-96): guidellm draws lengths from a normal distribution clipped
to a range, so it gets the uniform ranges' mean and standard deviation, clipped to the same ranges. Its numbers
are taken as guidellm reports them (its ITL is each request's mean gap between tokens after the first, weighted by
its tokens). `--client builtin` runs the same load through tinyserve.loadgen instead (vLLM's `bench serve` method:
token-id prompts, every gap of every stream pooled for ITL), for a machine without guidellm.

Both servers run the same model on the same number of threads, each in its fastest form here:
- tinyserve serve, its defaults (the fused Numba kernels, quant auto), compiled before serving (`--compile wait`);
- llama-server built from the llama.cpp that bench-peers measures (tools/peers/build_llama_server.py), on the GGUF
  of llama.cpp's fastest format (--llama-format: IQ4_NL, the fastest batched decode and prefill in docs/peers.md),
  with --cont-batching and -np slots.
Both servers stay up for the whole run and take turns: at each rate both are measured, the one that goes first
alternating from rate to rate. The idle one's CPU time during the other's turn is recorded (it should be ~0).

The SLO (--slo-ttft, --slo-itl: p90 TTFT <= 1 s and p90 ITL <= 100 ms by default, every request answered): the
rate a server "holds" is the highest rate of the sweep at which it and every lower rate meet it. The headline is
tinyserve's held rate / llama-server's. A full run (not --quick) is recorded as docs/bench-serve/<date>.json and
docs/bench-serve.md is regenerated from every recorded run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "peers"))
sys.path.insert(0, str(ROOT))
import build_llama_server  # noqa: E402  (standard library only)

from tinyserve.measure import cpu_info, format_table as text_table, git_commit  # noqa: E402

TINY, LLAMA = "tinyserve", "llama-server"
SERVERS = (TINY, LLAMA)
DEFAULT_RATES = (0.5, 1.0, 2.0, 3.0, 4.0)
QUICK_RATES = (0.5, 2.0)


# --- the workload and the summary: pure, tested without servers ----------------------------------------------------

@dataclass(frozen=True, slots=True)
class Settings:
    rates: tuple[float, ...] = DEFAULT_RATES
    seconds: float = 30.0             # arrivals last about this long at each rate
    min_requests: int = 16            # at low rates: enough requests for a p90
    prompt_len: tuple[int, int] = (32, 256)     # inclusive, uniform: `tinyserve bench`'s mix
    output_len: tuple[int, int] = (16, 96)
    seed: int = 0
    threads: int = 2
    slo_ttft: float = 1.0             # s, p90
    slo_itl: float = 0.1              # s, p90

    def num_requests(self, rate: float) -> int:
        return max(self.min_requests, math.ceil(rate * self.seconds))


def parse_rates(text: str) -> tuple[float, ...]:
    """"0.5,1,2" -> (0.5, 1.0, 2.0): positive, strictly increasing (the held rate is read along the sweep)."""
    try:
        rates = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--rates wants comma-separated numbers of requests/s, got {text!r}") from None
    if not rates or any(not r > 0 or not math.isfinite(r) for r in rates):
        raise ValueError(f"--rates wants positive finite requests/s, got {text!r}")
    if any(b <= a for a, b in zip(rates, rates[1:])):
        raise ValueError(f"--rates must be strictly increasing, got {text!r}")
    return rates


def workload(st: Settings, rate: float, vocab_size: int, salt: int = 0):
    """(requests, arrival times) at one rate: the same for every server. Token-id prompts, fixed output lengths."""
    from tinyserve.bench import Workload
    from tinyserve.loadgen import ClientRequest, poisson_arrivals

    n = st.num_requests(rate)
    seed = st.seed + salt
    reqs = Workload(n, st.prompt_len, st.output_len, seed).requests(vocab_size)
    return ([ClientRequest(prompt, p.max_new_tokens) for prompt, p in reqs],
            poisson_arrivals(n, rate, seed))


def percentile_ms(values, q: float) -> float:
    a = np.asarray(values, dtype=float)
    return float(np.percentile(a, q) * 1e3) if a.size else float("nan")


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request (seconds)."""
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """vLLM's time per output token: the decode part of the request over its tokens after the first."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def summarize(records: list[RequestRecord], seconds: float) -> dict:
    """One server at one rate: counts, throughput and the latency percentiles (ms) over the answered requests."""
    done = [r for r in records if r.ok]
    ttft = [r.ttft for r in done if r.ttft is not None]
    itl = [g for r in done for g in r.itl]               # every gap of every stream, as vLLM pools them
    tpot = [t for r in done if (t := r.tpot) is not None]
    e2e = [r.e2e for r in done if r.e2e is not None]
    out = {"requests": len(records), "completed": len(done), "failed": len(records) - len(done),
           "seconds": seconds, "requests_per_s": len(done) / seconds if seconds > 0 else float("nan"),
           "output_tokens_per_s": sum(r.output_tokens for r in done) / seconds if seconds > 0 else float("nan")}
    for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_ms"] = percentile_ms(values, q)
    errors = sorted({r.error for r in records if r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def length_mix(lo: int, hi: int) -> dict:
    """guidellm's clipped normal with the mean and standard deviation of the uniform lo..hi (inclusive)."""
    if not 1 <= lo <= hi:
        raise ValueError(f"a length range must satisfy 1 <= lo <= hi, got {lo}:{hi}")
    n = hi - lo + 1
    return {"mean": round((lo + hi) / 2), "stdev": round(math.sqrt((n * n - 1) / 12)), "min": lo, "max": hi}


def guidellm_scenario(url: str, model: str, rate: float, n: int, st: Settings, tokenizer: Path, out: Path,
                      salt: int = 0) -> dict:
    """One `guidellm run --scenario` file: Poisson at `rate`, n requests, the length mix, fixed output lengths."""
    p, o = length_mix(*st.prompt_len), length_mix(*st.output_len)
    return {"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
                    "timeout": 600.0},
        "profile": {"kind": "poisson", "rate": [rate]},
        "constraints": [{"kind": "max_requests", "count": n}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "data": [{"kind": "synthetic_text",
                  "prompt_tokens": p["mean"], "prompt_tokens_stdev": p["stdev"],
                  "prompt_tokens_min": p["min"], "prompt_tokens_max": p["max"],
                  "output_tokens": o["mean"], "output_tokens_stdev": o["stdev"],
                  "output_tokens_min": o["min"], "output_tokens_max": o["max"]}],
        "seed": {"kind": "static", "value": st.seed + salt},
        "outputs": [{"kind": "json", "path": str(out)}],
    }}


def summary_from_guidellm(bench: dict) -> dict:
    """One benchmark of guidellm's JSON report in summarize()'s shape (its own percentiles, not recomputed)."""
    m = bench["metrics"]
    totals = m["request_totals"]
    seconds = bench["duration"]
    out = {"requests": int(totals["total"]), "completed": int(totals["successful"]),
           "failed": int(totals["total"] - totals["successful"]), "seconds": seconds,
           "requests_per_s": totals["successful"] / seconds if seconds > 0 else float("nan"),
           "output_tokens_per_s": m["output_token_count"]["successful"]["total_sum"] / seconds
           if seconds > 0 else float("nan")}
    keys = {"ttft": "time_to_first_token_ms", "itl": "inter_token_latency_ms", "tpot": "time_per_output_token_ms",
            "e2e": "request_latency"}
    for name, key in keys.items():
        dist = m[key]["successful"]
        scale = 1e3 if name == "e2e" else 1.0          # guidellm's request latency is in seconds
        for q in (50, 90, 99):
            v = dist["percentiles"][f"p{q}"] if dist.get("count") else None
            out[f"{name}_p{q}_ms"] = float("nan") if v is None else v * scale
    return out


def slo_verdict(summary: dict, slo_ttft: float, slo_itl: float) -> tuple[bool, list[str]]:
    """Whether one (server, rate) meets the SLO, and what broke it. A NaN percentile (nothing answered) fails."""
    why = []
    if summary["failed"]:
        why.append(f"{summary['failed']} of {summary['requests']} requests failed")
    ttft, itl = summary["ttft_p90_ms"], summary["itl_p90_ms"]
    if not ttft <= slo_ttft * 1e3:
        why.append(f"p90 TTFT {ttft:.0f} ms > {slo_ttft * 1e3:.0f}")
    if not itl <= slo_itl * 1e3:
        why.append(f"p90 ITL {itl:.0f} ms > {slo_itl * 1e3:.0f}")
    return not why, why


def held_rate(rows: list[dict], server: str) -> float:
    """The highest rate at which `server` met the SLO there and at every lower rate of the sweep (0: not even the
    lowest). rows: {"rate", "server", "slo_met"}. A pass above a failure does not count: it is noise, not capacity."""
    held = 0.0
    for rate in sorted({r["rate"] for r in rows if r["server"] == server}):
        met = [r["slo_met"] for r in rows if r["server"] == server and r["rate"] == rate]
        if not all(met):
            break
        held = rate
    return held


def held_ratio(rows: list[dict], top_rate: float) -> dict:
    """tinyserve's held rate / llama-server's, and what the number means at the sweep's edges."""
    t, l = held_rate(rows, TINY), held_rate(rows, LLAMA)
    missing = [name for name in SERVERS if not any(r["server"] == name for r in rows)]
    if missing:
        return {TINY: t, LLAMA: l, "ratio": None, "note": f"{' and '.join(missing)} not run"}
    if l == 0:
        note = "neither holds the lowest rate" if t == 0 else "llama-server holds no rate of the sweep"
        return {TINY: t, LLAMA: l, "ratio": None, "note": note}
    note = "tinyserve holds the sweep's top rate: the ratio is a lower bound" if t == top_rate else ""
    return {TINY: t, LLAMA: l, "ratio": t / l, "note": note}


def server_order(rate_index: int) -> tuple[str, str]:
    """Who goes first at the i-th rate: alternating, so neither always runs on the fresher machine."""
    return SERVERS if rate_index % 2 == 0 else SERVERS[::-1]


def format_rows(rows: list[dict]) -> str:
    head = ["rate /s", "server", "done", "req/s", "out tok/s", "TTFT p50", "p90", "p99", "ITL p50", "p90", "p99",
            "TPOT p90", "E2E p90", "SLO"]
    body = [head]
    for r in rows:
        s = r["summary"]
        f = lambda k: "-" if not math.isfinite(s[k]) else f"{s[k]:.0f}"  # noqa: E731
        body.append([f"{r['rate']:g}", r["server"], f"{s['completed']}/{s['requests']}", f"{s['requests_per_s']:.2f}",
                     f"{s['output_tokens_per_s']:.0f}", f("ttft_p50_ms"), f("ttft_p90_ms"), f("ttft_p99_ms"),
                     f("itl_p50_ms"), f("itl_p90_ms"), f("itl_p99_ms"), f("tpot_p90_ms"), f("e2e_p90_ms"),
                     "✓" if r["slo_met"] else "✗ " + "; ".join(r["slo_why"])])
    return text_table(body, markdown=True)


# --- the record: docs/bench-serve/*.json, one per full run, and docs/bench-serve.md generated from them -----------

TABLE_HEAD = """# tinyserve serve against llama-server, as measured

Generated by `make bench-serve` (tools/bench_serve.py) from the runs recorded in `docs/bench-serve/*.json`;
regenerate with `.venv/bin/python tools/bench_serve.py --table`. Do not edit by hand.

The same offered load against both servers in one run (vLLM's `bench serve` method: Poisson arrivals at each rate,
streaming `/v1/completions`, token-id prompts of 32-256 tokens, 16-96 output tokens with EOS ignored; latencies at
the client, in ms). Both servers on the same machine and the same number of threads, taking turns at each rate.
"held" is the highest rate at which a server met the SLO (p90 TTFT and p90 ITL within the bounds named, every
request answered) there and at every lower rate; the ratio is tinyserve's held rate / llama-server's (goal: 1.5x).
These are 2-core cloud VMs, shared and noisy: compare within a row, not across rows.
"""


def write_table(docs: Path) -> Path:
    """docs/bench-serve.md from every docs/bench-serve/*.json, newest first: the held rates, then every rate."""
    runs = sorted((json.loads(f.read_text()) for f in (docs / "bench-serve").glob("*.json")),
                  key=lambda r: r["time"], reverse=True)
    held_rows = [["date (UTC)", "commit", "CPU", "threads", "llama.cpp format", "SLO (p90)", "rates /s",
                  "tinyserve holds", "llama-server holds", "tinyserve / llama-server", "load avg"]]
    for r in runs:
        st, h = r["settings"], r["held"]
        ratio = "-" if h["ratio"] is None else f"{h['ratio']:.2f}x" + (" (≥)" if h["note"].endswith("bound") else "")
        held_rows.append([r["time"][:16], r["commit"], r["cpu"]["model"], str(st["threads"]), r["llama_format"],
                          f"TTFT ≤ {st['slo_ttft'] * 1e3:.0f} ms, ITL ≤ {st['slo_itl'] * 1e3:.0f} ms",
                          ",".join(f"{x:g}" for x in st["rates"]), f"{h[TINY]:g}/s", f"{h[LLAMA]:g}/s", ratio,
                          f"{r['load_average']['start'][0]:.1f} → {r['load_average']['end'][0]:.1f}"])
    text = TABLE_HEAD + "\n## Held rate within the SLO\n\n" + text_table(held_rows, markdown=True) + "\n"
    for r in runs:
        text += f"\n## {r['time'][:16]} ({r['commit']}, {r['cpu']['model']})\n\n" + format_rows(r["rows"]) + "\n"
    out = docs / "bench-serve.md"
    out.write_text(text)
    return out


def record_run(result: dict, docs: Path) -> Path:
    runs = docs / "bench-serve"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.strptime(result["time"][:16], "%Y-%m-%d %H:%M"))
    path = runs / f"{stamp}-t{result['settings']['threads']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


# --- the servers ---------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_command(binary: Path, gguf: Path, port: int, threads: int, slots: int, ctx_per_slot: int) -> list[str]:
    """llama-server as a CPU user would run it for many clients: continuous batching over `slots` sequences, each
    with room for the longest request; no web UI; the same threads for decode and prefill as tinyserve gets."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
            "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching",
            "--no-webui", "--alias", "smollm2"]


def tinyserve_command(python: str, port: int) -> list[str]:
    return [python, "-m", "tinyserve", "serve", "--port", str(port), "--compile", "wait"]


def thread_env(threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), NUMBA_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
               OPENBLAS_NUM_THREADS=str(threads))
    env.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))
    return env


@dataclass
class Server:
    name: str
    cmd: list[str]
    port: int
    log: Path
    env: dict | None = None
    proc: subprocess.Popen | None = None
    model: str = ""
    vocab_size: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 900.0) -> None:
        import httpx

        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) while starting; its log: {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    models = httpx.get(self.url + "/v1/models", timeout=5).json()["data"]
                    self.model = models[0]["id"]
                    return
            except (httpx.HTTPError, ValueError, KeyError, IndexError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; its log: {self.log}")

    def cpu_seconds(self) -> float:
        """CPU time (user + system) of the server process, all its threads, so far."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def records_of(report) -> list[RequestRecord]:
    """loadgen's per-client results as RequestRecords: answered = 200, a finish reason, no error."""
    out = []
    for c in report.results:
        ok = c.status == 200 and bool(c.finish_reason) and not c.error
        err = None if ok else (c.error or f"HTTP {c.status}")
        out.append(RequestRecord(ok, c.completion_tokens or len(c.chunk_times), c.ttft, c.e2e, c.itl,
                                 err[:200] if err else None))
    return out


def measure(server: Server, requests, arrivals, concurrency: int) -> tuple[list[RequestRecord], float]:
    from tinyserve.loadgen import run_arrivals

    report = asyncio.run(run_arrivals(server.url, server.model, requests, arrivals, concurrency=concurrency,
                                      timeout=300.0))
    return records_of(report), report.seconds


def measure_guidellm(guidellm: str, server: Server, rate: float, st: Settings, salt: int, work: Path) -> dict:
    """One `guidellm run` against `server` at `rate`; its summary. Its log and report stay in `work`."""
    tag = f"{server.name}-{rate:g}"
    out, scenario = work / f"guidellm-{tag}.json", work / f"scenario-{tag}.json"
    out.unlink(missing_ok=True)
    from tinyserve.weights import DEFAULT_WEIGHTS_DIR
    scenario.write_text(json.dumps(guidellm_scenario(server.url, server.model, rate, st.num_requests(rate), st,
                                                     DEFAULT_WEIGHTS_DIR, out, salt), indent=1))
    # one worker process: on 2 cores guidellm's default (up to 10 spawned workers) costs ~30 s of start-up each run
    # and takes CPU from the server under test; one asyncio worker keeps hundreds of streams open
    env = dict(os.environ, GUIDELLM__MAX_WORKER_PROCESSES="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    log = work / f"guidellm-{tag}.log"
    with open(log, "w") as f:
        rc = subprocess.run([guidellm, "run", "--scenario", str(scenario), "--disable-console-interactive"],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work).returncode
    if rc or not out.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"guidellm failed against {server.name} at {rate:g}/s (exit {rc}); {log}:\n{tail}")
    return summary_from_guidellm(json.loads(out.read_text())["benchmarks"][0])


def warm_up(server: Server, vocab_size: int) -> None:
    """A few requests before any timing: first-call costs (page faults, thread pools, the prefix of lazy init)."""
    from tinyserve.loadgen import ClientRequest, run_arrivals

    reqs = [ClientRequest([3 + (i * 7919 + j) % (vocab_size - 3) for j in range(64)], 8) for i in range(4)]
    report = asyncio.run(run_arrivals(server.url, server.model, reqs, np.zeros(len(reqs)), concurrency=4))
    bad = [r for r in records_of(report) if not r.ok]
    if bad:
        raise RuntimeError(f"{server.name}: the warm-up requests failed: {bad[0].error}")


def client_name(client: str, guidellm: str) -> str:
    if client == "builtin":
        return "tinyserve.loadgen (vLLM bench serve method)"
    try:
        v = subprocess.run([guidellm, "--version"], capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        v = ""
    return f"guidellm {v.split()[-1] if v else '?'}"


def llama_version(binary: str) -> str:
    """llama-server --version's line naming the build (it prints to stderr)."""
    try:
        r = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "?"
    lines = [ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "?"


def gguf_for(fmt: str, gguf: str | None) -> Path:
    """The GGUF of llama.cpp's `fmt`: made beside the shipped Q4_1 by `make peer-venvs` (tools/peers/quantize_gguf)."""
    from quantize_gguf import output_path    # standard library only
    from tinyserve.weights import GGUF_MEMBER, cache_dir

    q4_1 = Path(gguf) if gguf else cache_dir() / Path(GGUF_MEMBER).name
    return q4_1 if fmt == "Q4_1" else output_path(q4_1, fmt)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="tinyserve serve vs llama-server under the same Poisson load")
    ap.add_argument("--rates", default=None, help="requests/s, comma-separated, increasing (0.5,1,2,3,4)")
    ap.add_argument("--seconds", type=float, default=None, help="arrivals last about this long per rate (30)")
    ap.add_argument("--min-requests", type=int, default=None, help="requests per rate at least (16)")
    ap.add_argument("--quick", action="store_true", help="rates 0.5 and 2, 10 s each, 8 requests at least: a check")
    ap.add_argument("--threads", type=int, default=2, help="threads of each server (2)")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="p90 TTFT bound, s (1.0)")
    ap.add_argument("--slo-itl", type=float, default=0.1, help="p90 ITL bound, s (0.1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", default=",".join(SERVERS), help=f"subset of {','.join(SERVERS)}")
    ap.add_argument("--llama-format", default="IQ4_NL", help="llama.cpp's GGUF format for llama-server (IQ4_NL)")
    ap.add_argument("--llama-slots", type=int, default=32, help="llama-server -np (32)")
    ap.add_argument("--llama-server", default=None, help="the llama-server binary (default: the cached build)")
    ap.add_argument("--gguf", default=None, help="the Q4_1 GGUF the other formats sit beside (default: cached)")
    ap.add_argument("--client", choices=["guidellm", "builtin"], default="builtin",
                    help="guidellm (default) or builtin: tinyserve.loadgen, vLLM's bench serve method")
    ap.add_argument("--guidellm", default=str(ROOT / ".venv-guidellm" / "bin" / "guidellm"),
                    help="the guidellm command (default: .venv-guidellm's)")
    ap.add_argument("--concurrency", type=int, default=256, help="client connections at most (open loop: many)")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "serve.json"))
    ap.add_argument("--docs", default=str(ROOT / "docs"))
    ap.add_argument("--record", choices=["auto", "yes", "no"], default="auto",
                    help="record in docs/bench-serve/ and regenerate docs/bench-serve.md (auto: not --quick)")
    ap.add_argument("--table", action="store_true", help="only regenerate docs/bench-serve.md")
    a = ap.parse_args(argv)
    try:
        rates = parse_rates(a.rates) if a.rates else (QUICK_RATES if a.quick else DEFAULT_RATES)
    except ValueError as e:
        ap.error(str(e))
    servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    if not servers or any(s not in SERVERS for s in servers):
        ap.error(f"--servers names {', '.join(SERVERS)}; got {a.servers!r}")
    for name in ("seconds", "slo_ttft", "slo_itl"):
        if (v := getattr(a, name)) is not None and not v > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    for name in ("threads", "llama_slots", "concurrency", "min_requests"):
        if (v := getattr(a, name)) is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    a.servers = servers
    a.settings = Settings(rates=rates, seconds=a.seconds or (10.0 if a.quick else 30.0),
                          min_requests=a.min_requests or (8 if a.quick else 16), seed=a.seed, threads=a.threads,
                          slo_ttft=a.slo_ttft, slo_itl=a.slo_itl)
    return a


def start_servers(a: argparse.Namespace, st: Settings, log_dir: Path) -> dict[str, Server]:
    servers = {}
    if TINY in a.servers:
        servers[TINY] = Server(TINY, tinyserve_command(sys.executable, port := free_port()), port,
                               log_dir / "tinyserve.log", env=thread_env(st.threads))
    if LLAMA in a.servers:
        binary = Path(a.llama_server) if a.llama_server else build_llama_server.server_path()
        if not binary.is_file():
            raise SystemExit(f"bench-serve: no llama-server at {binary}: `make peer-server` builds it")
        gguf = gguf_for(a.llama_format, a.gguf)
        if not gguf.is_file():
            raise SystemExit(f"bench-serve: no {a.llama_format} GGUF at {gguf}: `make peer-venvs` makes it")
        ctx = st.prompt_len[1] + st.output_len[1] + 64
        servers[LLAMA] = Server(LLAMA, llama_command(binary, gguf, port := free_port(), st.threads, a.llama_slots,
                                                     ctx), port, log_dir / "llama-server.log")
    for s in servers.values():
        print(f"starting {s.name}: {' '.join(s.cmd)}", flush=True)
        s.start()
    return servers


def run(a: argparse.Namespace) -> dict:
    st: Settings = a.settings
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cpu = {**cpu_info(), "cores": os.cpu_count()}
    load_start = os.getloadavg()
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores; load average {load_start[0]:.1f}")
    if load_start[0] > (cpu["cores"] or 1):
        print(f"warning: load average {load_start[0]:.1f} on {cpu['cores']} cores: other processes compete for the "
              f"CPU and both servers slow down; these numbers say little", file=sys.stderr)
    total = sum(st.num_requests(r) for r in st.rates)
    print(f"rates {', '.join(f'{r:g}' for r in st.rates)} requests/s, ~{st.seconds:g} s each ({total} requests per "
          f"server); prompts {st.prompt_len[0]}-{st.prompt_len[1]} tokens, outputs {st.output_len[0]}-"
          f"{st.output_len[1]}; SLO p90 TTFT <= {st.slo_ttft * 1e3:.0f} ms, p90 ITL <= {st.slo_itl * 1e3:.0f} ms; "
          f"{st.threads} threads per server", flush=True)
    if a.client == "guidellm" and not Path(a.guidellm).is_file():
        raise SystemExit(f"bench-serve: no guidellm at {a.guidellm}: `make bench-serve` installs it into "
                         f".venv-guidellm (or --client builtin)")
    print(f"client: {client_name(a.client, a.guidellm)}", flush=True)
    from tinyserve.tokenizer import load_tokenizer
    from tinyserve.weights import DEFAULT_WEIGHTS_DIR
    vocab = load_tokenizer(DEFAULT_WEIGHTS_DIR).vocab_size
    servers = start_servers(a, st, out.parent)
    rows = []
    try:
        for s in servers.values():
            warm_up(s, vocab)
        for i, rate in enumerate(st.rates):
            reqs, arrivals = workload(st, rate, vocab, salt=i)
            for name in server_order(i):
                if name not in servers:
                    continue
                s = servers[name]
                others = {o.name: o.cpu_seconds() for o in servers.values() if o is not s}
                if a.client == "guidellm":
                    try:
                        summary = measure_guidellm(a.guidellm, s, rate, st, i, out.parent)
                    except RuntimeError as e:          # one failed run is a missed SLO, not the end of the sweep
                        print(f"  {e}", file=sys.stderr)
                        summary = {**summarize([], 0.0), "requests": st.num_requests(rate),
                                   "failed": st.num_requests(rate), "errors": [str(e).splitlines()[0]]}
                else:
                    records, seconds = measure(s, reqs, arrivals, a.concurrency)
                    summary = summarize(records, seconds)
                idle = {k: servers[k].cpu_seconds() - v for k, v in others.items()}
                met, why = slo_verdict(summary, st.slo_ttft, st.slo_itl)
                rows.append({"rate": rate, "server": name, "summary": summary, "slo_met": met, "slo_why": why,
                             "idle_cpu_s_of_others": idle})
                print(f"  rate {rate:g}/s  {name:12s} {summary['completed']}/{summary['requests']} done in "
                      f"{summary['seconds']:.1f} s, TTFT p90 {summary['ttft_p90_ms']:.0f} ms, ITL p90 "
                      f"{summary['itl_p90_ms']:.0f} ms, {summary['output_tokens_per_s']:.0f} out tok/s  "
                      f"{'SLO met' if met else 'SLO missed: ' + '; '.join(why)}", flush=True)
    finally:
        for s in servers.values():
            s.stop()
    held = held_ratio(rows, st.rates[-1])
    result = {"time": time.strftime("%Y-%m-%d %H:%M %Z", time.gmtime()), "commit": git_commit(ROOT), "cpu": cpu,
              "settings": asdict(st), "servers": {n: s.cmd for n, s in servers.items()},
              "llama_format": a.llama_format, "client": client_name(a.client, a.guidellm),
              "llama_server_version": llama_version(servers[LLAMA].cmd[0]) if LLAMA in servers else None,
              "rows": rows, "held": held, "load_average": {"start": load_start, "end": os.getloadavg()}}
    print()
    print(format_rows(rows))
    ratio = "-" if held["ratio"] is None else f"{held['ratio']:.2f}x"
    print(f"\nheld within the SLO: tinyserve {held[TINY]:g}/s, llama-server {held[LLAMA]:g}/s; tinyserve / "
          f"llama-server = {ratio} {held['note']}")
    print(f"load average (1 min): {load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    docs = Path(a.docs)
    if a.table:
        print(f"wrote {write_table(docs)}")
        return 0
    result = run(a)
    out = Path(a.out)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if a.record == "yes" or (a.record == "auto" and not a.quick):
        print(f"recorded {record_run(result, docs)}")
        print(f"wrote {write_table(docs)}")
    failed = any(r["summary"]["completed"] == 0 for r in result["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
