"""The first run's JIT compile (lesson 7): announced, timed apart from the model, and off the first answer's path.

Numba compiles a kernel the first time it is called and keeps the machine code in an on-disk cache
(NUMBA_CACHE_DIR, kernels/__init__.py). From an empty cache the int8 path compiles for tens of seconds (the fused
layer calls and the LM head at the first prefill, the fused decode step at the first decode; docs/performance.md,
"The first run"). Called inside a timed request, that time lands in TTFT and in tokens/s: the first number a
newcomer sees would be the compiler's.

So nothing the user times calls a kernel cold. `warm_up` runs every kernel of a path once on the tiny synthetic
model: Numba specialises on types (float32 [T, D] C-contiguous, int8, ...), not on shapes, so the tiny model fills
the cache for SmolLM2 too. It then writes a stamp beside the cache that says which kernels it holds and for what
(the numba version, this CPU, the kernel sources' size and mtime: Numba itself drops a cache entry when its source
file changes). `is_warm` reads the stamp: warm, a run only loads the kernels (reported, not timed as the
model); cold, the CLI says so before compiling.

Cold, who waits? `BackgroundCompile` runs `python -m tinyserve compile` in a process of its own (at low priority)
while the answer starts on the NumPy path (`stand_in`: float32 arithmetic on the int8 weights' values, so the
tokens are those the fast path would pick, up to float order). When the compile is done the same Model object
`become`s the fast one between two tokens: the strategies look the model's fields up at every forward, and the
K/V cache is float32 on both paths, so the request goes on where it was.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .quant import AUTO, KERNEL_MODES, NONE, W4A8

WORKLOADS = ("kv", "engine")   # kv: generate's default strategy; engine: chat, serve, bench, --strategy paged
# seconds to compile from an empty cache on 2 cores (docs/performance.md, "The first run"): what the announcement
# promises before anything is known about this machine. W4A8 (quant=auto's pick on x86) compiles its 4-bit tiles
# beside the int8 LM head's, so it promises more
ESTIMATE_S = {"kv": 25, "engine": 35}
ESTIMATE_W4A8_S = {"kv": 45, "engine": 60}


def estimate_s(quant: str, workload: str) -> int:
    """The compile time the announcement promises for this mode and workload."""
    return (ESTIMATE_W4A8_S if quant == W4A8.name else ESTIMATE_S)[workload]


def workload_for(strategy: str) -> str:
    return "kv" if strategy in ("kv", "naive") else "engine"


def cache_dir() -> Path:
    from .backend import kernel_cache_dir
    return Path(kernel_cache_dir())


def cache_key(quant: str, workload: str) -> dict:
    """What a warm cache was made for; any change means Numba will compile again."""
    import llvmlite.binding as llvm
    import numba
    src = Path(__file__).parent / "kernels"
    return {"quant": quant, "workload": workload, "numba": numba.__version__, "python": sys.version.split()[0],
            "cpu": llvm.get_host_cpu_name(),
            "sources": {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(src.glob("*.py"))}}


def _stamp(quant: str, workload: str) -> Path:
    return cache_dir() / f"tinyserve-warm-{quant}-{workload}.json"


def is_warm(quant: str, workload: str = "kv") -> bool:
    """Does the on-disk cache hold every kernel of this path (for this numba, CPU and kernel source)?"""
    try:
        return json.loads(_stamp(quant, workload).read_text()) == cache_key(quant, workload)
    except (OSError, ValueError):
        return False


def warm_up(quant: str, workload: str = "kv", log=None) -> float:
    """Call every kernel of the path once on the tiny model (compiling it, or loading it from the cache); write the
    stamp. Returns the seconds it took. log(str) gets one line per phase."""
    from .engine import Engine
    from .kv_cache import KVCache, forward_with_cache, prefill
    from .backend import set_backend
    from .sampling import SamplingParams
    from .weights import tiny_model

    if quant not in KERNEL_MODES or workload not in WORKLOADS:
        modes = f"{', '.join(KERNEL_MODES[:-1])} or {KERNEL_MODES[-1]}"
        raise ValueError(f"warm_up: quant must be {modes} and workload one of {WORKLOADS}, got {quant!r}, "
                         f"{workload!r}")
    # a tiny model whose matrices' inputs split into blocks of 64 (w8a8-64); the kernels compile for types, not sizes
    model = set_backend(tiny_model(seed=0, dim=128, intermediate_size=192), quant, "numba")
    t_all = time.perf_counter()

    def phase(i: int, n: int, what: str, fn) -> None:
        t = time.perf_counter()
        fn()
        if log:
            log(f"[{i}/{n}] {what}: {time.perf_counter() - t:.1f} s")

    cache = KVCache.allocate(model.config, 32)
    # 20 rows reach the tiled causal attention, 3 rows the few-rows one (dense_attention.FEW_ROWS = 16)
    phases = [("prefill: the fused layer calls, causal attention, LM head",
               lambda: (prefill(model, cache, list(range(3, 23))), forward_with_cache(model, cache, [5, 6, 7]))),
              ("the fused decode step", lambda: [forward_with_cache(model, cache, [t]) for t in (8, 9)])]
    if workload == "engine":
        def engine_run():   # 5 sequences: prefill chunks, then decode batches of 5 (three calls) and fewer (fused)
            e = Engine(model, num_blocks=32, block_size=16)
            e.generate([list(range(3, 23))] + [[4 + i] * 5 for i in range(4)],
                       [SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True) for n in (4, 2, 2, 3, 3)])
        phases.append(("paged attention (the Engine: chat, serve, bench)", engine_run))
    for i, (what, fn) in enumerate(phases, 1):
        phase(i, len(phases), what, fn)
    path = _stamp(quant, workload)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(cache_key(quant, workload)))
    tmp.replace(path)   # atomic: a reader sees no stamp or a whole one
    return time.perf_counter() - t_all


def compile_argv(quant: str, workload: str) -> list[str]:
    """The child's command line: this Python, this tinyserve, the same NUMBA_CACHE_DIR (inherited)."""
    return [sys.executable, "-m", "tinyserve", "compile", "--quant", quant, "--workload", workload]


class BackgroundCompile:
    """`python -m tinyserve compile` in a child process at low priority, its output in a log beside the cache.

    A second tinyserve started meanwhile finds the lock file and waits for the same child instead of starting
    another compile of the same kernels."""

    def __init__(self, quant: str, workload: str = "kv", argv: list[str] | None = None):
        self.quant, self.workload = quant, workload
        d = cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        self.log_path = d / f"tinyserve-compile-{quant}-{workload}.log"
        self.lock = d / f"tinyserve-compiling-{quant}-{workload}.pid"
        self.started = time.time()       # wall clock: an attached compile started in another process
        self.proc: subprocess.Popen | None = None
        self.pid = _live_pid(self.lock)
        if self.pid is not None:
            try:
                self.started = self.lock.stat().st_mtime
            except OSError:
                pass
        if self.pid is None:          # nobody is compiling these kernels: we do
            argv = argv or compile_argv(quant, workload)
            with open(self.log_path, "w") as log:
                # a session of its own: it may outlive us (`make run` returns when the answer is done) and a
                # Ctrl-C typed later at the shell is not for it; at low priority: the answer in front goes first
                self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             start_new_session=True, preexec_fn=lambda: os.nice(10))
            self.pid = self.proc.pid
            self.lock.write_text(str(self.pid))
        self.seconds: float | None = None   # the compile's wall time from its start, once done

    def done(self) -> bool:
        """Has the child finished (successfully or not)? Cheap: call it between two tokens."""
        if self.seconds is not None:
            return True
        finished = self.proc.poll() is not None if self.proc is not None else _live_pid(self.lock) is None
        if finished:
            self.seconds = time.time() - self.started    # the compile's wall time, from its start
            if self.proc is not None:
                self.lock.unlink(missing_ok=True)
        return finished

    @property
    def ok(self) -> bool:
        return self.done() and is_warm(self.quant, self.workload)

    def lines(self) -> list[str]:
        """The child's log so far: one line per phase."""
        try:
            return self.log_path.read_text().strip().splitlines()
        except OSError:
            return []

    def wait(self, log=None, every: float = 0.5) -> bool:
        """Block until done, passing every new log line to log(line); True if the cache is now warm."""
        shown = 0
        while True:
            finished = self.done()
            lines = self.lines()
            for line in lines[shown:] if log else ():
                log(line)
            shown = len(lines)
            if finished:
                return self.ok
            time.sleep(every)

    def stop(self) -> None:
        """Ctrl-C or an error in front: end our child (kernels compiled so far stay cached)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
        if self.proc is not None:
            self.lock.unlink(missing_ok=True)


def _live_pid(lock: Path) -> int | None:
    """The pid in the lock file if that process still runs, else None."""
    try:
        pid = int(lock.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def stand_in(fast):
    """The NumPy path for a quantised model: the int8 weights dequantized once to float32 (x @ (wq * s) instead of
    (x @ wq) * s), so the tokens are those the fast path would pick, up to float order. [D_in, O] float32 each."""
    from .quant import MATRICES
    layers = [dataclasses.replace(w, **{f: getattr(w, f).dequantize() for f in MATRICES}) for w in fast.layers]
    head = np.ascontiguousarray(fast.lm_head_q.dequantize())                         # [D, V]
    return dataclasses.replace(fast, layers=layers, lm_head_q=head, quant=NONE.name, backend="numpy", fast=None)


def become(model, other) -> None:
    """Make `model` the same model as `other`, in place (every field). Safe between two forwards: the strategies
    read the weights and the backend from the Model at every call, and both paths keep float32 K/V."""
    for f in dataclasses.fields(model):
        setattr(model, f.name, getattr(other, f.name))


@dataclasses.dataclass(slots=True)
class Kernels:
    """How this process got the fast path's kernels, for the summary line; while `background` compiles, the
    request runs on the stand-in and `switch` makes it the fast model once the cache is warm."""
    how: str                               # "cache" (loaded) | "compiled" (here, before timing) | "background"
    seconds: float | None = None           # loading / compiling; for "background": the child's wall time once done
    bg: BackgroundCompile | None = None
    fast: object | None = None             # the fast Model (for "background", until the switch)
    switched_at: int | None = None         # tokens generated on the stand-in before the switch
    load_seconds: float = 0.0              # loading the compiled kernels into this process at the switch
    blas_limit: object | None = None       # threadpoolctl's limit while on the stand-in (restored at the switch)

    def ready(self) -> bool:
        """Has the background compile finished, warm, and is the stand-in still running? Cheap: call it often."""
        return self.bg is not None and self.switched_at is None and self.bg.done() and self.bg.ok

    def load(self) -> float:
        """Load the freshly compiled kernels into this process and pack the weights for them (any thread; the
        stand-in keeps answering)."""
        self.seconds = self.bg.seconds
        self.load_seconds = warm_up(self.fast.quant, self.bg.workload) + pack(self.fast)
        return self.load_seconds

    def move(self, target, at: int) -> None:
        """The swap, at a safe point (no forward in flight): `target` runs on the fast model from its next forward.
        target: the stand-in Model itself (generate: it becomes the fast one in place) or the Engine running it
        (chat, serve: use_model). `at`: tokens, steps or turns done before it. BLAS gets its threads back."""
        from .model import Model
        if isinstance(target, Model):
            become(target, self.fast)
        else:
            use_model(target, self.fast)
        self.switched_at = at
        if self.blas_limit is not None:
            self.blas_limit.restore_original_limits()
            self.blas_limit = None

    def switch(self, target, at: int) -> float:
        """At a safe point: if the background compile is done and warm, load the kernels and move `target` (a Model
        or an Engine) to the fast path. Returns the seconds spent (not the model's time)."""
        if not self.ready():
            return 0.0
        self.load()
        self.move(target, at)
        return self.load_seconds

    def leave_compiling(self, log, what: str = "run") -> None:
        """Done before the compile: leave it running on its own (detached: it outlives this process) and say
        where its log is; the next start finds the cache warm."""
        if self.bg is not None and not self.bg.done():
            log(f"[the kernels go on compiling in the background (first run only, log: {self.bg.log_path}), so "
                f"that the next {what} starts on the fast path]")


def prepare(fast, workload: str, background: bool, log) -> tuple[object, Kernels]:
    """The model to run and how its kernels came: loaded from a warm cache; compiled here, announced, before
    anything is timed; or (background=True) compiling in a child process while the stand-in answers."""
    quant = fast.quant
    if is_warm(quant, workload):
        return fast, Kernels("cache", warm_up(quant, workload) + pack(fast), fast=fast)
    what = f"the {quant} kernels for this CPU (first run only, ~{estimate_s(quant, workload)} s)"
    if background:
        bg = BackgroundCompile(quant, workload)
        log(f"[compiling {what} in the background; the answer starts on the NumPy path and moves to the fast path "
            f"when they are ready (log: {bg.log_path})]")
        # the stand-in's BLAS gets one thread: the other core compiles, and two BLAS threads on a busy core make a
        # decode step many times slower; process-wide, so the server's engine thread too
        from threadpoolctl import threadpool_limits
        return stand_in(fast), Kernels("background", bg=bg, fast=fast, blas_limit=threadpool_limits(1, "blas"))
    log(f"[compiling {what}; not counted in TTFT or tokens/s]")
    return fast, Kernels("compiled", warm_up(quant, workload, log=lambda line: log(f"  {line}")) + pack(fast),
                         fast=fast)


def pack(fast) -> float:
    """Lay the weights out for the kernels now (backend.prepare), as part of loading them: packed lazily, the first
    request's prefill paid for it, and the fast path's TTFT came out longer than the NumPy stand-in's. Returns the
    seconds it took."""
    from .backend import prepare as pack_weights
    t = time.perf_counter()
    pack_weights(fast)
    return time.perf_counter() - t


def replay(model, prompt: list[int], out: list[int]) -> tuple[float, float | None]:
    """The fast path's TTFT and tokens/s on the same work as an answer already given: prefill the prompt, then one
    decode step per generated token (its forwards are exactly those of generating them; sampling is ~free)."""
    from .kv_cache import KVCache, forward_with_cache, prefill
    from .kv_sizing import max_kv_positions
    cache = KVCache.allocate(model.config, max_kv_positions(len(prompt), len(out), model.config.max_seq_len))
    t0 = time.perf_counter()
    prefill(model, cache, prompt)
    t1 = time.perf_counter()
    for tok in out[:-1]:                   # the last token is never run through the model
        forward_with_cache(model, cache, [tok])
    t2 = time.perf_counter()
    return t1 - t0, ((len(out) - 1) / (t2 - t1) if len(out) > 1 and t2 > t1 else None)


def use_model(engine, model) -> None:
    """Run the Engine's next steps on `model` and on the attention kernel of its backend (both chosen at
    Engine(...) from the model). Call it between two steps, from the thread that steps: the server and chat move
    from the stand-in to the fast model this way. The K/V pool is float32 on both paths and stays as it is."""
    from .attention_backends import get_paged_attention
    if model.config != engine.config:
        raise ValueError("use_model: the new model has another config; its K/V would not fit the engine's pool")
    engine.model, engine.backend = model, model.backend
    engine._attend = get_paged_attention(model.backend, checked=False)   # what Engine.__init__ picks for it


def main(args) -> int:
    """`python -m tinyserve compile`: fill the on-disk cache with one path's kernels (what BackgroundCompile runs).
    --start: only start that in the background and return (`make run` does, so the compile overlaps the weights'
    download; the generate that follows finds it by its lock file and waits for it instead of compiling again)."""
    if args.quant == AUTO:                     # what `generate` will choose for SmolLM2 on this CPU
        from .backend import default_quant
        args.quant = default_quant()
    if args.start:
        if not is_warm(args.quant, args.workload):
            bg = BackgroundCompile(args.quant, args.workload)
            print(f"compiling the {args.quant} kernels for this CPU in the background (first run only, "
                  f"~{estimate_s(args.quant, args.workload)} s; log: {bg.log_path})", flush=True)
        return 0
    lock = cache_dir() / f"tinyserve-compiling-{args.quant}-{args.workload}.pid"
    print(f"compiling the {args.quant} kernels ({args.workload}) for this CPU into {cache_dir()} ...", flush=True)
    try:
        s = warm_up(args.quant, args.workload, log=lambda line: print(line, flush=True))
    finally:
        if lock.exists() and lock.read_text().strip() == str(os.getpid()):
            lock.unlink(missing_ok=True)
    print(f"done in {s:.1f} s", flush=True)
    return 0
