"""Small helpers the lesson notebooks share: where to put figures, a findings ledger, a timer (measure.py's).

`make lesson-N` runs a notebook with TINYSERVE_BUILD=build/lesson-NN; the notebook saves its figures there and
records its findings (each a number with the conditions it was measured under), which the runner prints.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .measure import time_repeated

_ROOT = Path(__file__).resolve().parent.parent


def build_dir(lesson: int | None = None) -> Path:
    d = Path(os.environ.get("TINYSERVE_BUILD", _ROOT / "build" / (f"lesson-{lesson:02d}" if lesson else "scratch")))
    d.mkdir(parents=True, exist_ok=True)
    return d


def savefig(fig, name: str, lesson: int | None = None) -> Path:
    path = build_dir(lesson) / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path


def record(finding: str, lesson: int | None = None, **numbers) -> None:
    """Append one finding (a sentence plus the numbers behind it) to build/lesson-NN/findings.jsonl."""
    _append(lesson, {"finding": finding, **numbers})
    print(finding)


def _append(lesson: int | None, row: dict) -> None:
    with open(build_dir(lesson) / "findings.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


# --- predictions as checked claims ------------------------------------------------------------------------------
# Every lesson predicts before it measures. The rule that turns the pair into a verdict is stated once, here:
#   a number prediction holds when the measurement lies within TOLERANCE (1.5x) of it, either way;
#   a comparison ("A takes ~r times B") holds when the median ratio lies within TOLERANCE of r AND every interleaved
#   round falls on the same side of 1 as r (a noisy machine may blur the size of a gap, not flip its sign).
# The verdict text is written from the numbers; a cell that gets "does not hold" must say why, next to it.

TOLERANCE = 1.5


@dataclass(frozen=True)
class Verdict:
    """One prediction against its measurement. `rounds`: per-round measured ratios, when the claim is a comparison."""
    what: str
    predicted: float
    measured: float
    unit: str = ""
    tolerance: float = TOLERANCE
    rounds: tuple[float, ...] = ()

    @property
    def ratio(self) -> float:
        """measured / predicted."""
        return self.measured / self.predicted if self.predicted else float("inf")

    @property
    def same_side(self) -> bool:
        """Every round on the predicted side of 1 (true for a plain number, or a predicted tie: they have no side)."""
        if not self.rounds or self.predicted == 1:
            return True
        return all((r > 1) == (self.predicted > 1) and r != 1 for r in self.rounds)

    @property
    def holds(self) -> bool:
        return 1 / self.tolerance <= self.ratio <= self.tolerance and self.same_side

    def __str__(self) -> str:
        u = f" {self.unit}" if self.unit else ""
        text = (f"{self.what}: predicted {self.predicted:.3g}{u}, measured {self.measured:.3g}{u} "
                f"(measured/predicted {self.ratio:.2f}x)")
        if self.rounds:
            text += f", rounds {min(self.rounds):.2f}-{max(self.rounds):.2f}"
        if self.holds:
            return text + f" -> holds (within {self.tolerance:g}x" + (", every round on one side)" if self.rounds else ")")
        why = [] if 1 / self.tolerance <= self.ratio <= self.tolerance else [f"outside {self.tolerance:g}x"]
        if not self.same_side:
            why.append("rounds on both sides of 1")
        return text + " -> DOES NOT HOLD (" + ", ".join(why) + ")"


def check_prediction(what: str, predicted: float, measured: float, unit: str = "", *,
                     rounds: Sequence[float] = (), tolerance: float = TOLERANCE,
                     lesson: int | None = None) -> Verdict:
    """Judge a prediction by the course's rule, print the verdict and record it with its numbers.

    For a comparison pass the predicted ratio, the median measured ratio and every interleaved round's ratio:
    `check_prediction("paged / contiguous step time", 1.0, med, rounds=per_round)`.
    """
    if not (np.isfinite(predicted) and np.isfinite(measured)) or predicted <= 0 or measured < 0:
        raise ValueError(f"{what}: a prediction needs a positive predicted and a non-negative measured number, "
                         f"got predicted={predicted!r}, measured={measured!r}")
    v = Verdict(what, float(predicted), float(measured), unit, float(tolerance), tuple(float(r) for r in rounds))
    record(str(v), lesson, what=v.what, predicted=v.predicted, measured=v.measured, holds=v.holds, kind="prediction",
           **_load_fields())
    return v


def median_time(fn: Callable[[], object], repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds, after `warmup` untimed calls (machines here are shared and noisy):
    measure.time_repeated's median, the timer every benchmark of the course uses."""
    return time_repeated(fn, repeat, warmup).median


# --- one measured machine for the whole course ----------------------------------------------------------------
# Every lesson's floor divides bytes by the same bandwidth: `machine()` measures it once per run of the course (the
# same buffer, the same threads, the same probe: roofline.measure_bandwidth's float32 matrix-vector product on BLAS's
# threads), with its spread over rounds, and caches it in build/machine.json. `make lessons` starts a run
# (TINYSERVE_COURSE_RUN); a lesson run on its own reuses a probe younger than MACHINE_MAX_AGE on this CPU. The probe
# runs on the thread count fit_threads() chose (below), and a probe taken on another count is measured again: a
# floor divides by the bandwidth of the threads the lesson's own timings run on.
# A path that cannot reach this bound (one thread, a Python loop) names the bound it uses instead.

MACHINE_FILE = "machine.json"
MACHINE_MAX_AGE = 3600.0          # seconds a probe is reused by lessons run one at a time
RUN_ENV = "TINYSERVE_COURSE_RUN"  # set by tools/run_lesson.py all: one probe for every lesson of the run


@dataclass(frozen=True)
class Machine:
    """This machine as the course measured it: read bandwidth (bytes/s) and float32 matmul rate (FLOP/s), each a
    median over rounds with its range, on `threads` threads."""
    bandwidth: float
    bandwidth_lo: float
    bandwidth_hi: float
    flops: float
    flops_lo: float
    flops_hi: float
    threads: int
    cpu: str
    run: str
    measured_at: float
    busy_cores: float            # other programs' load while it was measured (busy_check), in cores

    def describe(self) -> str:
        return (f"{self.cpu}, {self.threads} threads: read bandwidth {self.bandwidth / 1e9:.1f} GB/s "
                f"({self.bandwidth_lo / 1e9:.1f}-{self.bandwidth_hi / 1e9:.1f}), float32 matmul "
                f"{self.flops / 1e9:.0f} GFLOP/s ({self.flops_lo / 1e9:.0f}-{self.flops_hi / 1e9:.0f}); measured "
                f"{time.strftime('%H:%M:%S', time.localtime(self.measured_at))}"
                + (f" while other programs used {self.busy_cores:.1f} cores" if self.busy_cores >= BUSY_CORES else ""))


def _machine_path() -> Path:
    d = _ROOT / "build"
    d.mkdir(parents=True, exist_ok=True)
    return d / MACHINE_FILE


def machine(refresh: bool = False, rounds: int = 5) -> Machine:
    """The course's one measurement of this machine (cached per run of the course; see above), on the threads
    fit_threads() chose (each notebook calls it first), so every floor matches the threads the lesson runs on.
    Prints it."""
    from . import roofline
    from .measure import cpu_name

    run, cpu, path = os.environ.get(RUN_ENV, ""), cpu_name(), _machine_path()
    threads = _probe_threads()
    if not refresh:
        try:
            m = Machine(**json.loads(path.read_text()))
            fresh = (m.run == run) if run else (time.time() - m.measured_at < MACHINE_MAX_AGE)
            if fresh and m.cpu == cpu and m.threads == threads:
                print(m.describe() + " (the course's probe, cached for this run)")
                _note_machine(m)
                return m
        except (OSError, ValueError, TypeError):
            pass
    load = busy_check("the machine probe", quiet=True)
    from threadpoolctl import threadpool_limits
    with threadpool_limits(limits=threads, user_api="blas"):     # the probe runs on the threads the lessons run on
        bw = [roofline.measure_bandwidth(repeat=3) for _ in range(rounds)]
        fl = [roofline.measure_flops(repeat=3) for _ in range(max(1, rounds // 2))]
    m = Machine(float(np.median(bw)), min(bw), max(bw), float(np.median(fl)), min(fl), max(fl), threads,
                cpu, run, time.time(), load.other_cores)
    path.write_text(json.dumps(dataclasses.asdict(m)))
    print(m.describe())
    _note_machine(m)
    return m


def _probe_threads() -> int:
    """The threads the probe runs on: fit_threads()'s count once a notebook has called it, else BLAS's own."""
    if _fitted is not None:
        return _fitted.threads
    from threadpoolctl import threadpool_info
    counts = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    return max(counts) if counts else (os.cpu_count() or 1)


def _note_machine(m: Machine) -> None:
    """Write the bandwidth this lesson divides by into its findings (kind "machine", not a verdict): the runner
    compares every lesson's with the one the run measured (tools/run_lesson.py)."""
    if os.environ.get("TINYSERVE_BUILD"):
        _append(None, {"finding": f"bandwidth used: {m.bandwidth / 1e9:.1f} GB/s", "kind": "machine",
                       "bandwidth": m.bandwidth, "bandwidth_lo": m.bandwidth_lo, "bandwidth_hi": m.bandwidth_hi,
                       "run": m.run, "measured_at": m.measured_at})


# --- threads fitted to the free cores ---------------------------------------------------------------------------
# BLAS's and Numba's thread pools meet at a barrier after every parallel loop: each thread waits for the slowest.
# A core that another program keeps busy gives our thread there a time slice now and then, so every barrier waits
# for it, and on a 2-core machine beside one busy program two threads run a matmul slower than one thread does
# (docs/performance.md, "traps"). So each notebook starts by counting the cores other programs hold and runs BLAS and
# Numba on the rest (at least one). A run of the course (tools/run_lesson.py all) decides once and passes the count
# to every lesson in THREADS_ENV, so every lesson of the run runs, and divides by a probe taken, on one count.

THREADS_ENV = "TINYSERVE_THREADS"


@dataclass(frozen=True, slots=True)
class Threads:
    """The thread count a notebook runs BLAS and Numba on, and why."""
    threads: int
    cores: int
    busy: int                    # cores other programs hold (each held at least BUSY_CORES of the time)
    other_cores: float           # the load behind it: cores' worth of other programs' CPU time
    source: str                  # "load" (sampled now) or THREADS_ENV (set by the run of the course)

    def describe(self) -> str:
        noun = "thread" if self.threads == 1 else "threads"
        why = (f"{self.busy} busy with other programs ({self.other_cores:.1f} cores' load)" if self.source == "load"
               else f"the count this run of the course chose from the load at its start ({THREADS_ENV})")
        least = " (at least one)" if self.busy >= self.cores else ""
        return (f"{self.cores} cores, {why}: BLAS and Numba use {self.threads} {noun}{least}; the course's "
                f"bandwidth and matmul probe runs on {self.threads} too")


def choose_threads(other_cores: float, cores: int) -> int:
    """The threads to run on: the cores other programs leave free, at least 1. A core counts as held when another
    program keeps it busy at least BUSY_CORES of the time (one busy loop: 1.0; a browser's flicker: 0.1)."""
    if cores < 1 or not np.isfinite(other_cores) or other_cores < 0:
        raise ValueError(f"choose_threads: needs cores >= 1 and a non-negative load, got cores={cores!r}, "
                         f"other_cores={other_cores!r}")
    return max(1, cores - held_cores(other_cores, cores))


def held_cores(other_cores: float, cores: int) -> int:
    """How many cores other programs hold: their load rounded at BUSY_CORES (0.5 -> 1, 1.4 -> 1, 1.5 -> 2)."""
    return min(cores, int(np.floor(other_cores + 1 - BUSY_CORES)))


_fitted: Threads | None = None


def other_load(seconds: float = 0.5) -> float:
    """Cores' worth of CPU time other programs used over `seconds` (/proc/stat, steal counted as busy; our own
    process's CPU time, spinning pool threads included, is subtracted). The load average minus one elsewhere."""
    cores = os.cpu_count() or 1
    before, own0 = _cpu_ticks(), _own_seconds()
    if before is None:
        return max(0.0, os.getloadavg()[0] - 1)
    time.sleep(seconds)
    after, own1 = _cpu_ticks(), _own_seconds()
    total = (after[1] - before[1]) / _HZ
    if total <= 0:
        return 0.0
    others = (after[0] - before[0]) / _HZ - (own1 - own0)
    return max(0.0, cores * others / total)


def fit_threads(quiet: bool = False, refresh: bool = False) -> Threads:
    """Set BLAS's and Numba's threads to the cores other programs leave free (see above) and print one line saying
    so. Decided once per notebook (refresh=True decides again); THREADS_ENV, when set, is taken as it is."""
    global _fitted
    if _fitted is None or refresh:
        cores = os.cpu_count() or 1
        forced = os.environ.get(THREADS_ENV, "").strip()
        if forced:
            if not forced.isdigit() or int(forced) < 1:
                raise ValueError(f"{THREADS_ENV} must be a positive whole number of threads, got {forced!r}")
            n = min(int(forced), cores)
            _fitted = Threads(n, cores, cores - n, float(cores - n), THREADS_ENV)
        else:
            load = other_load()
            _fitted = Threads(choose_threads(load, cores), cores, held_cores(load, cores), load, "load")
        _apply_threads(_fitted.threads)
        if not quiet:
            print(_fitted.describe())
    return _fitted


def _apply_threads(n: int) -> None:
    """BLAS (every library NumPy loaded, through threadpoolctl) and Numba (this thread now; every engine step on
    the Numba path through backend.step_threads, whichever thread runs it) run on n threads."""
    from threadpoolctl import threadpool_limits
    from . import backend
    import sys
    threadpool_limits(limits=n, user_api="blas")
    if "numba" not in sys.modules:
        # not loaded yet (a NumPy-only lesson may never load it): its pool will start with n threads
        os.environ["NUMBA_NUM_THREADS"] = str(n)
        backend.NUMBA_THREADS = n
        return
    import numba
    backend.NUMBA_THREADS = n = min(n, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


# --- is the machine busy? ----------------------------------------------------------------------------------------
# A timing on a shared machine measures the model and whatever else runs. Before a timed comparison a lesson calls
# busy_check(): it samples, over a short sleep of our own, how many cores other programs kept busy (Linux's
# /proc/stat, steal time included: a virtual machine's neighbours), or the load average elsewhere. From BUSY_CORES
# on, the lesson says that this comparison's numbers cannot be trusted rather than explain them.

BUSY_CORES = 0.5


@dataclass(frozen=True)
class Load:
    what: str
    other_cores: float           # cores other programs used during the sample
    cores: int

    @property
    def busy(self) -> bool:
        return self.other_cores >= BUSY_CORES

    def __str__(self) -> str:
        if self.busy:
            return (f"{self.what}: other programs kept {self.other_cores:.1f} of {self.cores} cores busy: the timings "
                    f"below share the machine, and a verdict that fails may be theirs, not the model's")
        return f"{self.what}: machine quiet ({self.other_cores:.1f} of {self.cores} cores busy elsewhere)"


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs from /proc/stat (steal counted as busy), or None off Linux."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)          # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_check(what: str = "this comparison", seconds: float = 0.5, quiet: bool = False) -> Load:
    """How many cores other programs use right now (we sleep while it samples), printed unless quiet. Unless quiet,
    it also opens the window that the next verdicts are judged over (window_load)."""
    cores = os.cpu_count() or 1
    before = _cpu_ticks()
    if before is None:
        load = Load(what, max(0.0, os.getloadavg()[0] - 1), cores)
    else:
        time.sleep(seconds)
        after = _cpu_ticks()
        busy, total = after[0] - before[0], after[1] - before[1]
        load = Load(what, cores * busy / total if total else 0.0, cores)
    if not quiet:
        print(load)
        global _last_load, _window
        _last_load = load
        _window = (_cpu_ticks(), _own_seconds())
    return load


_last_load: Load | None = None     # the lesson's latest busy_check: each verdict records the load it ran under
_window: tuple | None = None       # (/proc/stat ticks, this process's CPU seconds) when that busy_check ended

_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _own_seconds() -> float:
    """CPU seconds this process and its finished children used (every thread: BLAS's, Numba's)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def window_load() -> Load | None:
    """The cores other programs used between the latest busy_check and now: the whole timed window, not the half
    second before it (a burst of load that starts mid-measurement shows here). Our own CPU time is subtracted from the
    machine's busy time. None off Linux or before any busy_check."""
    if _window is None or _window[0] is None or _last_load is None:
        return None
    now = _cpu_ticks()
    if now is None:
        return None
    (busy0, total0), own0 = _window
    total = now[1] - total0
    if total <= 0:
        return None
    cores = _last_load.cores
    others = (now[0] - busy0) / _HZ - (_own_seconds() - own0)
    return Load(_last_load.what, max(0.0, cores * others / (total / _HZ)), cores)


def current_load() -> Load | None:
    """The load a verdict is judged under: the busier of the busy_check before its timing and the whole window since."""
    during = window_load()
    if _last_load is None or (during is not None and during.other_cores > _last_load.other_cores):
        return during
    return _last_load


def _load_fields() -> dict:
    """{"busy_cores": ..., "busy": ...}: current_load() when a verdict is recorded, or {} if there was no busy_check."""
    load = current_load()
    if load is None:
        return {}
    return {"busy_cores": round(load.other_cores, 2), "busy": load.busy}


# --- the learner switch: your exercise functions inside the engine ---------------------------------------------
# TINYSERVE_SOLUTION=learner (or `make lesson-N LEARNER=1`) makes `import tinyserve` replace every reference function
# that a lesson's exercises.py implements by the learner's own: their KV cache generates the text, their allocator
# and scheduler run inside the Engine, their trie serves the chat. Which names are exercises, and where their
# reference lives, is read from each lesson's self-check table (REFERENCE in tests/lessons/test_lesson_NN.py), so a
# new lesson is picked up without touching this file. Off (the default), nothing here runs.

SOLUTION_ENV = "TINYSERVE_SOLUTION"


def exercise_table(lesson: int) -> dict[str, str]:
    """{exercise name: 'tinyserve.module:name'} of a lesson: the literal REFERENCE table of its self-check file."""
    import ast
    path = _ROOT / "tests" / "lessons" / f"test_lesson_{lesson:02d}.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "REFERENCE" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path} has no REFERENCE = {{...}} table")


def course_lessons() -> dict[int, Path]:
    """{lesson number: its exercises.py} for every lesson that has self-checks."""
    out = {}
    for test in sorted((_ROOT / "tests" / "lessons").glob("test_lesson_[0-9][0-9].py")):
        n = int(test.stem[-2:])
        folders = sorted((_ROOT / "lessons").glob(f"{n:02d}_*/exercises.py"))
        if folders:
            out[n] = folders[0]
    return out


def implemented_names(path: Path) -> dict[str, bool]:
    """{name: implemented?} for every function and class the file defines. A function is a stub when its body is
    only `raise NotImplementedError(...)` (after the docstring); a class when any of its methods is."""
    import ast

    def is_stub(fn) -> bool:
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
            return False
        exc = body[0].exc.func if isinstance(body[0].exc, ast.Call) else body[0].exc
        return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"

    out = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = not is_stub(node)
        elif isinstance(node, ast.ClassDef):
            methods = [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
            out[node.name] = not any(is_stub(m) for m in methods)
    return out


class LearnerSwitch:
    """The rebinding done by use_learner_code: which names are the learner's, and how to undo it (restore())."""

    def __init__(self):
        self.used: dict[int, list[str]] = {}       # lesson -> exercise names now running the learner's code
        self.pending: dict[int, list[str]] = {}    # lesson -> exercise names still stubs (the reference runs)
        self.files: dict[int, Path] = {}
        self.broken: dict[int, str] = {}           # lesson -> why its exercises.py did not import (the reference runs)
        self.places: dict[str, list[str]] = {}     # exercise -> where it was rebound ("tinyserve.engine.plan_step", ...)
        self._undo: list[Callable[[], None]] = []

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.used.clear()

    def __enter__(self) -> "LearnerSwitch":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def banner(self) -> str:
        bar = "=" * 100
        lines = [bar, f" {SOLUTION_ENV}=learner: tinyserve runs YOUR exercise functions where you have implemented them"]
        for n in sorted(self.files):
            rel = self.files[n].relative_to(_ROOT) if self.files[n].is_relative_to(_ROOT) else self.files[n]
            if n in self.broken:
                lines.append(f"   lesson {n} ({rel}): DOES NOT IMPORT, the reference runs: {self.broken[n][:120]}"
                             f" (make check-{n} shows where)")
                continue
            yours = ", ".join(self.used.get(n, [])) or "none yet"
            lines.append(f"   lesson {n} ({rel}): yours: {yours}")
            if self.pending.get(n):
                lines.append(f"{'':14}still the reference (stubs): {', '.join(self.pending[n])}")
        lines.append(" A wrong answer here can make generation fail or produce garbage: `make check-N` says which.")
        lines.append(bar)
        return "\n".join(lines)

    def _set(self, owner, name: str, value) -> None:
        self._where.append(f"{getattr(owner, '__module__', '') + '.' if isinstance(owner, type) else ''}"
                           f"{owner.__qualname__ if isinstance(owner, type) else owner.__name__}.{name}")
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def _set_defaults(self, fn, attr: str, value) -> None:
        self._where.append(f"{fn.__module__}.{fn.__qualname__}({attr})")
        old = getattr(fn, attr)
        setattr(fn, attr, value)
        self._undo.append(lambda: setattr(fn, attr, old))

    def rebind(self, original, replacement) -> int:
        """Point every reference to `original` in the loaded tinyserve modules at `replacement`: module attributes
        (`from .x import f` made a copy of the name in each importer), class attributes, and default arguments
        (`attend=grouped_attention` was bound when the function was defined). Returns how many were changed."""
        import sys
        import types
        self._where = []
        count = 0
        for mod_name, module in list(sys.modules.items()):
            if module is None or not (mod_name == "tinyserve" or mod_name.startswith("tinyserve.")):
                continue
            for name, value in list(vars(module).items()):
                if value is original:
                    self._set(module, name, replacement)
                    count += 1
                functions = []
                if isinstance(value, types.FunctionType) and value.__module__ == mod_name:
                    functions.append(value)
                elif isinstance(value, type) and value.__module__ == mod_name:
                    for attr, member in list(vars(value).items()):
                        inner = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
                        if inner is original:
                            self._set(value, attr, type(member)(replacement) if inner is not member else replacement)
                            count += 1
                        elif isinstance(inner, types.FunctionType):
                            functions.append(inner)
                        elif isinstance(member, property) and member.fget is not None:
                            functions.append(member.fget)
                for fn in functions:
                    if fn.__defaults__ and any(d is original for d in fn.__defaults__):
                        self._set_defaults(fn, "__defaults__",
                                           tuple(replacement if d is original else d for d in fn.__defaults__))
                        count += 1
                    if fn.__kwdefaults__ and any(d is original for d in fn.__kwdefaults__.values()):
                        self._set_defaults(fn, "__kwdefaults__", {k: replacement if d is original else d
                                                                 for k, d in fn.__kwdefaults__.items()})
                        count += 1
        return count


def _import_path(path: Path, name: str):
    """Import a file as module `name` (registered in sys.modules while it runs: dataclasses look it up there)."""
    import importlib.util
    import sys
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"cannot import {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def use_learner_code(lessons: list[int] | None = None, files: dict[int, Path] | None = None,
                     quiet: bool = False) -> LearnerSwitch:
    """Replace the reference functions by the learner's implemented exercise functions (see the comment above).

    lessons: which lessons (default: all with self-checks); files: {lesson: exercises file} to use instead of
    lessons/NN_*/exercises.py (tests use it). Returns the switch; .restore() (or `with`) undoes it.
    """
    import importlib
    import sys

    available = course_lessons()
    files = {**available, **(files or {})}
    if not files:
        raise ValueError(f"{SOLUTION_ENV}=learner needs the course checkout: lessons/NN_*/exercises.py and "
                         f"tests/lessons/test_lesson_NN.py next to the tinyserve package ({_ROOT})")
    chosen = sorted(files) if lessons is None else lessons
    switch = LearnerSwitch()
    # import every exercises file first, against the reference: a learner's file may build on reference pieces
    learner: dict[int, object] = {}
    for n in chosen:
        if n not in files:
            raise ValueError(f"lesson {n} has no exercises.py with self-checks; have {sorted(files)}")
        path = Path(files[n]).resolve()
        switch.files[n] = path
        try:
            learner[n] = _import_path(path, f"tinyserve_learner_exercises_{n:02d}")
        except Exception as e:   # noqa: BLE001 - one broken file must not stop the other lessons' code from running
            switch.broken[n] = f"{type(e).__name__}: {e}"
    for n in chosen:
        if n in switch.broken:
            continue
        done = implemented_names(switch.files[n])
        for name, target in exercise_table(n).items():
            if not done.get(name, False):
                switch.pending.setdefault(n, []).append(name)
                continue
            module, _, attr = target.partition(":")
            original = getattr(importlib.import_module(module), attr)
            changed = switch.rebind(original, getattr(learner[n], name))
            switch.places[name] = switch._where
            if changed == 0:
                raise RuntimeError(f"{target} was not found in any loaded tinyserve module: cannot use yours")
            switch.used.setdefault(n, []).append(name)
    if not quiet:
        print(switch.banner(), file=sys.stderr, flush=True)
    return switch


def apply_env_switch() -> LearnerSwitch | None:
    """Called at the end of `import tinyserve`: TINYSERVE_SOLUTION=learner (all lessons) or learner:2,4 (some)."""
    value = os.environ.get(SOLUTION_ENV, "").strip()
    if value in ("", "reference"):
        return None
    kind, _, which = value.partition(":")
    if kind != "learner":
        raise ValueError(f"{SOLUTION_ENV} must be 'reference', 'learner' or 'learner:1,2', got {value!r}")
    lessons = [int(x) for x in which.split(",") if x.strip()] or None
    return use_learner_code(lessons)


# --- floors, robust fits, interleaved timings and the text after a verdict ----------------------------------------
# A floor is a bound the measurement can never beat (bytes / the machine's bandwidth): it is judged as a floor, not
# as an estimate. It holds when the measurement is at or above it, allowing for the probe's own spread (the fastest
# probe round sets how low a bound can honestly be); the verdict says by how much the measurement exceeds it, which
# is the share of the time the bound does not explain.

@dataclass(frozen=True)
class Floor:
    """A measurement against a lower bound. `spread`: the bound's own uncertainty as a factor >= 1 (the bandwidth
    probe's median / its fastest round): a measurement down to floor / spread still respects the bound."""
    what: str
    floor: float
    measured: float
    unit: str = ""
    bound: str = ""              # what the floor counts: the bytes and the bandwidth it divides them by
    spread: float = 1.0

    @property
    def ratio(self) -> float:
        """measured / floor: 1 means the bound explains all of the time."""
        return self.measured / self.floor if self.floor else float("inf")

    @property
    def holds(self) -> bool:
        return self.measured >= self.floor / self.spread

    @property
    def explained(self) -> float:
        """The share of the measured time the bound accounts for (floor / measured, at most 1)."""
        return min(1.0, self.floor / self.measured) if self.measured else 1.0

    def __str__(self) -> str:
        u = f" {self.unit}" if self.unit else ""
        bound = f" ({self.bound})" if self.bound else ""
        text = f"{self.what}: floor {self.floor:.3g}{u}{bound}, measured {self.measured:.3g}{u} = {self.ratio:.2f}x the floor"
        if self.holds:
            return text + (f" -> holds (a floor: measured >= floor); the bound accounts for {self.explained:.0%} "
                           f"of the time")
        return text + (f" -> BELOW ITS FLOOR (even allowing the probe's spread, {self.spread:.2f}x): the bound counts "
                       f"bytes or work this measurement did not do")


def check_floor(what: str, floor: float, measured: float, unit: str = "", *, bound: str = "", spread: float = 1.0,
                lesson: int | None = None) -> Floor:
    """Judge a measurement against a floor (see above), print the verdict and record it with its numbers.
    `spread`: the bound's uncertainty factor, e.g. machine().bandwidth_hi / machine().bandwidth for a byte floor."""
    if not (np.isfinite(floor) and np.isfinite(measured)) or floor <= 0 or measured < 0 or spread < 1:
        raise ValueError(f"{what}: a floor needs a positive floor, a non-negative measurement and a spread >= 1, "
                         f"got floor={floor!r}, measured={measured!r}, spread={spread!r}")
    f = Floor(what, float(floor), float(measured), unit, bound, float(spread))
    record(str(f), lesson, what=f.what, floor=f.floor, measured=f.measured, ratio=f.ratio, holds=f.holds, kind="floor",
           **_load_fields())
    return f


def bandwidth_spread(m: "Machine") -> float:
    """How much faster than its median the bandwidth probe ran at best: the slack of every byte floor."""
    return max(1.0, m.bandwidth_hi / m.bandwidth)


def explain(verdict: "Verdict | Floor", load: "Load | None", why: str | Callable[[], str] = "",
            lesson: int | None = None) -> str:
    """The text after a verdict, printed and returned: the course's one way to read a verdict.

    It holds: nothing to add (''). It fails while other programs held the machine: say that this comparison could
    not be judged here, never explain it away. "Held" is the busy_check taken before the timing (`load`), or the
    whole window since it (window_load: load can start mid-way), or a second sample taken now, after it. The ledger then marks the verdict "too busy"
    (tools/run_lesson.py). It fails on a quiet machine: `why`, which the caller builds from the measured numbers
    (a callable is only evaluated then)."""
    if verdict.holds:
        return ""
    if load is None or not load.busy:
        during = window_load()
        if during is not None and during.busy:
            load = during
    if load is None or not load.busy:
        after = busy_check(load.what if load is not None else verdict.what, quiet=True)
        load = after if after.busy or load is None else load
    if load.busy:
        text = (f"  the machine was too busy for this comparison: other programs held {load.other_cores:.1f} of "
                f"{load.cores} cores while it ran, so this failure says nothing about the model; run it again on a "
                f"quiet machine")
        _append(lesson, {"finding": f"{verdict.what}: too busy to judge", "kind": "too_busy", "what": verdict.what,
                         "busy_cores": round(load.other_cores, 2)})
    else:
        text = "  why: " + (why() if callable(why) else why) if why else "  why: (no reason computed)"
    print(text)
    return text


def too_busy(what: str, load: "Load", reason: str, lesson: int | None = None) -> None:
    """A prediction the lesson could not measure because the machine was too slow for its time cap (e.g. a serving
    run cut short): recorded as a verdict that did not hold, marked too busy, with the reason printed."""
    text = f"{what}: not measured: the machine was too busy ({reason})"
    record(text, lesson, what=what, holds=False, kind="prediction", busy=True, too_busy=True,
           busy_cores=round(load.other_cores, 2))


def theil_sen(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the line through (x, y) by Theil-Sen: the median of the slopes of every pair of points,
    then the median of y - slope * x. Up to ~29 % of the points can be anything (a burst of another program's load)
    without moving it, where least squares follows a single outlier."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"theil_sen needs two 1-D sequences of the same length >= 2, got {x.shape} and {y.shape}")
    i, j = np.triu_indices(len(x), k=1)
    keep = x[j] != x[i]
    if not keep.any():
        raise ValueError("theil_sen needs at least two distinct x values")
    slope = float(np.median((y[j] - y[i])[keep] / (x[j] - x[i])[keep]))
    return slope, float(np.median(y - slope * x))


def interleaved(cases: dict[str, Callable[[], object]], rounds: int = 5, warmup: int = 1,
                budget_s: float | None = None) -> dict[str, list[float]]:
    """Seconds per call of each case, timed in turn within every round (a, b, c, a, b, c, ...), so a burst of load
    from another program hits every case alike instead of faking a difference. {name: [seconds per round]}.
    budget_s: stop after the round that passes this many seconds (warm-up included), keeping at least 2 rounds, so
    a busy machine shortens the measurement instead of stretching the lesson."""
    if rounds < 1 or warmup < 0 or not cases:
        raise ValueError(f"interleaved: needs cases, rounds >= 1 and warmup >= 0, got {len(cases)}, {rounds}, {warmup}")
    start = time.perf_counter()
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    out: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(rounds):
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            out[name].append(time.perf_counter() - t0)
        if budget_s is not None and r >= 1 and time.perf_counter() - start > budget_s:
            print(f"(time budget of {budget_s:g} s reached: {r + 1} of {rounds} rounds)")
            break
    return out
