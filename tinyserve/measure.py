"""One way to measure: the timer, the summary of repeated runs, what "decode tokens/s" and "prefill tokens/s" mean,
the CPU line and the table every benchmark here prints.

Every number tinyserve publishes (lesson notebooks, `speed`, `bench`, `make bench-peers`, the README's tables) is
taken the way this module says, so that two of them can be compared:
- a run is timed on the wall clock (time.perf_counter) after untimed warm-up calls (the first call pays for page
  faults, JIT compiles, BLAS threads waking up);
- repeated runs are summarised by their median and their spread, min-max (`Spread`): these machines are shared, a
  median ignores the one run a neighbour slowed, and min-max says how much the neighbours moved the others;
- decode tokens/s counts only the engine steps in which every scheduled sequence was a plain decode (`decode_rate`):
  prefill rows would otherwise be counted as if they were decode steps, and a decode rate that includes prefill is
  a different number (bench.py's "out tok/s": output tokens over the whole run);
- prefill tokens/s is the prompt's tokens over the time to its last position's logits (`prefill_rate`).
The workloads that produce these rates (which prompts, which Engine) are speed.py's; this module imports nothing of
tinyserve, so that every module, roofline.py and speculative.py included, can time with it.
"""
from __future__ import annotations

import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence


@dataclass(frozen=True, slots=True)
class Spread:
    """n runs of one measurement (seconds, tokens/s or a ratio): their median and their range lo-hi (min-max)."""
    median: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Iterable[float]) -> "Spread":
        values = list(values)
        if not values:
            raise ValueError("Spread.of needs at least one value")
        return cls(statistics.median(values), min(values), max(values), len(values))

    def fmt(self, digits: int = 1, unit: str = "") -> str:
        """"20.0 (10.0-45.0)", or the median alone when there was one run (a range of one says nothing)."""
        m = f"{self.median:.{digits}f}{unit}"
        return m if self.n == 1 else f"{m} ({self.lo:.{digits}f}-{self.hi:.{digits}f})"

    def __str__(self) -> str:
        return self.fmt()


def time_repeated(fn: Callable[[], object], repeat: int = 5, warmup: int = 1,
                  reset: Callable[[], object] | None = None, clock: Callable[[], float] = time.perf_counter) -> Spread:
    """Seconds per call of fn(): `repeat` timed calls after `warmup` untimed ones.

    reset: called after every call (warm-up included), outside the timing; e.g. rewinding the KV cache a timed
    forward appended to, so that every call sees the same state. clock: time.process_time to count CPU time
    instead of wall time (what a busy neighbour does not steal, but also not what a user waits for).
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"time_repeated: repeat must be >= 1 and warmup >= 0, got {repeat}, {warmup}")
    times = []
    for i in range(warmup + repeat):
        t0 = clock()
        fn()
        t1 = clock()
        if reset is not None:
            reset()
        if i >= warmup:
            times.append(t1 - t0)
    return Spread.of(times)


@dataclass(frozen=True, slots=True)
class Rate:
    """tokens processed in seconds: one measured run of a decode or a prefill."""
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def decode_rate(steps: Iterable) -> Rate:
    """Decode tokens/s as every benchmark here means it, from an Engine's step stats (step_batch.StepStats).

    Only the steps in which every scheduled sequence was a plain decode count (one row each, one token sampled):
    a step that prefills a prompt, or verifies speculative drafts (more rows than sequences), is a different
    workload. tokens: what those steps sampled (B per step at batch B); seconds: their StepStats.seconds (schedule,
    forward and sampling: what a decoding user waits for between two tokens).
    """
    plain = [s for s in steps if s.num_decode == s.num_seqs == s.num_tokens]
    if not plain:
        raise ValueError("decode_rate: no plain decode step to time (did every request finish in its prefill?)")
    return Rate(sum(s.num_sampled for s in plain), sum(s.seconds for s in plain))


def prefill_rate(run_prefill: Callable[[], object], n_tokens: int) -> tuple[Rate, object]:
    """Prefill tokens/s: the n_tokens of one prompt over the time run_prefill() takes to return its last position's
    logits (a fresh cache, one call, no warm-up inside: the caller warms up once for all rounds). Returns the rate
    and what run_prefill returned (the logits, to check the next token outside the timing)."""
    t0 = time.perf_counter()
    out = run_prefill()
    return Rate(n_tokens, time.perf_counter() - t0), out


# --- the machine ----------------------------------------------------------------------------------------------------

# the /proc/cpuinfo flags that decide which int8 kernels and which BLAS paths run (kernels/isa.py chooses among them)
CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def git_commit(root: Path | None = None) -> str:
    """The commit a measurement ran on: the short hash, "-dirty" if tracked files have uncommitted changes, or
    "unknown" outside a git checkout. root: the checkout (default: the one this package lives in)."""
    root = Path(__file__).resolve().parent.parent if root is None else root
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def cpu_info(cpuinfo_text: str | None = None) -> dict:
    """{"model": name, "flags": the CPU_FLAGS_OF_NOTE it has}, from /proc/cpuinfo's text (its first CPU listed).

    Without text: this machine's /proc/cpuinfo, or (elsewhere) what `platform` knows of the processor, no flags.
    Printed beside every speed figure: a tokens/s means little without the CPU it was measured on.
    """
    own = cpuinfo_text is None
    if own:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo_text = f.read()
        except OSError:
            cpuinfo_text = ""
    model, flags, family, number = "unknown", None, None, None
    for line in cpuinfo_text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name":
            model = value
        elif key == "flags":
            flags = set(value.split())
        elif key == "cpu family":
            family = value
        elif key == "model":
            number = value
    if own and model == "unknown":                     # arm64 Linux lists no model name; macOS has no cpuinfo
        model = platform.processor() or platform.machine() or "unknown"
    if family and number and model != "unknown":
        # a cloud VM often names only the brand, one name for several generations of a vendor's server CPUs;
        # family and model tell them apart, which is what a figure measured on it needs
        model = f"{model} (family {family}, model {number})"
    return {"model": model, "flags": [f for f in CPU_FLAGS_OF_NOTE if f in (flags or ())]}


def cpu_name() -> str:
    """This CPU's model name as the OS reports it, with family and model where known."""
    return cpu_info()["model"]


# --- the table ------------------------------------------------------------------------------------------------------

def format_table(rows: Sequence[Sequence[str]], markdown: bool = False) -> str:
    """rows[0] is the header. Plain text: the first column left-aligned, the others right-aligned (numbers), a rule
    of dashes under the header. markdown=True: the same cells as a Markdown table, for the README."""
    rows = [[str(c) for c in r] for r in rows]
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    cells = [[c.ljust(width[i]) if i == 0 else c.rjust(width[i]) for i, c in enumerate(r)] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in cells]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    else:
        lines = ["  ".join(r) for r in cells]
        lines.insert(1, "  ".join("-" * w for w in width))
    return "\n".join(lines)
