#!/usr/bin/env python
"""Execute a lesson notebook headless: `make lesson-N` (or `all`); `make lesson-N LEARNER=1` on your own code.

Prints one line per code cell as it finishes (its time and first line), then what the lesson found. The executed
copy and its figures go to build/lesson-NN/. A lesson folder may hold more than one notebook (lesson 7: lesson_7a.ipynb,
lesson_7b.ipynb): they run in name order, one kernel each, into the same build folder. Plots use the non-interactive Agg backend here (MPLBACKEND), so the
notebooks themselves never pick a backend: opened in Jupyter (`make notebook`) they show their plots inline.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_PER_CELL = 900


def notebooks() -> dict[int, list[Path]]:
    """{lesson: its notebooks}: lessons/NN_*/lesson*.ipynb, in name order."""
    out: dict[int, list[Path]] = {}
    for p in sorted((ROOT / "lessons").glob("[0-9][0-9]_*/lesson*.ipynb")):
        out.setdefault(int(p.parent.name[:2]), []).append(p)
    return out


def first_line(source: str) -> str:
    for line in source.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", "import ", "from ")):
            return line if len(line) <= 70 else line[:67] + "..."
    return source.strip().splitlines()[0][:70] if source.strip() else "(empty)"


class ProgressClient(NotebookClient):
    """NotebookClient that reports every code cell as it completes: index, seconds, first line."""

    def __init__(self, nb, **kw):
        super().__init__(nb, **kw)
        self._code_cells = sum(c.cell_type == "code" for c in nb.cells)
        self._done = 0
        self._t_cell = time.perf_counter()
        self.on_cell_start = self._start
        self.on_cell_executed = self._complete

    def _start(self, cell, cell_index):
        self._t_cell = time.perf_counter()

    def _complete(self, cell, cell_index, execute_reply=None):
        if cell.cell_type != "code":
            return
        self._done += 1
        print(f"   [{self._done:>2}/{self._code_cells}] {time.perf_counter() - self._t_cell:6.1f} s  "
              f"cell {cell_index:>2}: {first_line(cell.source)}", flush=True)


# --- the verdict ledger: one row per verdict, so a quiet run and a busy run can be set side by side -------------------

def claim(row: dict) -> str:
    """A verdict's name without its numbers (a rate or a batch the run computed), so two runs' rows pair up."""
    what = row.get("what") or row["finding"].split(": predicted")[0].split(": floor")[0].split(":")[0]
    return re.sub(r"\d+(?:\.\d+)?", "#", what).strip()


def ledger_rows(n: int, rows: list[dict]) -> list[dict]:
    """The verdicts of one lesson's findings: {lesson, what, key, kind, held, busy, too_busy}. A verdict is too busy
    when its timing ran busy (busy_check before it) and it failed, or when course.explain found load after it."""
    flagged = {r["what"] for r in rows if r.get("kind") == "too_busy"}
    out, seen = [], {}
    for r in rows:
        if "holds" not in r:
            continue
        key = claim(r)
        seen[key] = seen.get(key, 0) + 1
        busy = bool(r.get("busy"))
        out.append({"lesson": n, "what": r.get("what") or key, "key": f"{key} #{seen[key]}" if seen[key] > 1 else key,
                    "kind": r.get("kind", "prediction"), "held": bool(r["holds"]), "busy": busy,
                    "too_busy": not r["holds"] and (busy or r.get("too_busy", False) or r.get("what") in flagged)})
    return out


def bandwidths_used(rows: list[dict]) -> list[float]:
    return [r["bandwidth"] for r in rows if r.get("kind") == "machine"]


def check_bandwidth(n: int, used: list[float], run_bw: dict | None) -> str:
    """One line: did lesson n divide by the run's one bandwidth (within its printed spread)?"""
    if not used:
        return f"   bandwidth: lesson {n} divides by no bandwidth"
    if run_bw is None:
        return f"   bandwidth: {used[0] / 1e9:.1f} GB/s"
    lo, hi = run_bw["bandwidth_lo"], run_bw["bandwidth_hi"]
    off = [b for b in used if not lo <= b <= hi]
    if off:
        return (f"   bandwidth: DIFFERENT from the run's {run_bw['bandwidth'] / 1e9:.1f} GB/s "
                f"({lo / 1e9:.1f}-{hi / 1e9:.1f}): this lesson used {', '.join(f'{b / 1e9:.1f}' for b in off)} GB/s")
    return f"   bandwidth: the run's {run_bw['bandwidth'] / 1e9:.1f} GB/s (within its spread {lo / 1e9:.1f}-{hi / 1e9:.1f})"


def cell_of(row: dict | None) -> str:
    if row is None:
        return "-"
    return "held" if row["held"] else ("too busy" if row["too_busy"] else "FAILED")


def compare(a: list[dict], b: list[dict]) -> tuple[str, int]:
    """The side-by-side table of two ledgers (quiet, busy) and how many verdicts differ without saying too busy.
    A verdict counts as the same when both runs reached it, or the busy run said it was too busy to judge."""
    index = lambda ledger: {(r["lesson"], r["key"]): r for r in ledger}     # noqa: E731
    qa, qb = index(a), index(b)
    keys = list(qa) + [k for k in qb if k not in qa]
    width = max([len(k[1]) for k in keys] + [10])
    width = min(width, 80)
    lines = [f"{'lesson':>6}  {'verdict':{width}s}  {'quiet':8s}  {'busy':8s}  same?"]
    differ = 0
    for k in keys:
        ra, rb = qa.get(k), qb.get(k)
        if ra is None or rb is None:
            same = "only in one run"
            differ += 1
        elif ra["held"] == rb["held"]:
            same = "same"
        elif rb["too_busy"]:
            same = "said too busy"
        elif rb["busy"]:             # held only in the busy run: its load check printed that the timings shared the cores
            same = "said busy (held anyway)"
        elif ra["too_busy"]:
            same = "said too busy (quiet run)"
        else:
            same = "DIFFERS"
            differ += 1
        lines.append(f"{k[0]:>6}  {k[1][:width]:{width}s}  {cell_of(ra):8s}  {cell_of(rb):8s}  {same}")
    lines.append(f"{len(keys)} verdicts; {differ} differ without saying the machine was too busy")
    return "\n".join(lines), differ


def run(n: int, paths: list[Path], run_bw: dict | None = None, ledger: list | None = None) -> bool:
    out = ROOT / "build" / f"lesson-{n:02d}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "findings.jsonl").unlink(missing_ok=True)
    os.environ["TINYSERVE_BUILD"] = str(out)
    ok = all([run_notebook(n, path, out) for path in paths])      # every notebook, even after one fails
    findings = out / "findings.jsonl"
    if findings.exists():
        print("   what the lesson found:")
        rows = [json.loads(line) for line in findings.read_text().splitlines()]
        for row in rows:
            print("    -", row["finding"])
        verdicts = [r for r in rows if "holds" in r]
        if verdicts:     # the ledger the closing note compares, quiet run against busy run
            held = sum(r["holds"] for r in verdicts)
            busy = sum(1 for r in verdicts if r.get("busy"))
            print(f"   verdicts: {held} of {len(verdicts)} held; {busy} measured while other programs held the cores "
                  f"(busy_check)")
            for r, led in zip(verdicts, ledger_rows(n, rows)):
                load = "" if "busy" not in r else (" [busy %.1f cores]" % r.get("busy_cores", 0.0) if r["busy"] else " [quiet]")
                print(f"     {cell_of(led):8s} {led['kind']:11s}{led['what'][:90]}{load}")
            if ledger is not None:
                ledger.extend(ledger_rows(n, rows))
        print(check_bandwidth(n, bandwidths_used(rows), run_bw))
    figures = sorted(out.glob("*.png"))
    if figures:
        print("   figures:", ", ".join(str(f.relative_to(ROOT)) for f in figures))
    return ok


def run_notebook(n: int, path: Path, out: Path) -> bool:
    os.environ["MPLBACKEND"] = "Agg"             # headless; the notebooks do not choose a backend themselves
    os.environ["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
    nb = nbformat.read(path, as_version=4)
    who = " on YOUR exercise code (TINYSERVE_SOLUTION=" + os.environ["TINYSERVE_SOLUTION"] + ")" \
        if os.environ.get("TINYSERVE_SOLUTION") else ""
    print(f"== lesson {n}: {path.relative_to(ROOT)} ({sum(c.cell_type == 'code' for c in nb.cells)} code cells){who}",
          flush=True)
    t0 = time.perf_counter()
    ok = True
    # IPC transport (a local socket file) instead of TCP: no network port, and no "running over TCP without
    # encryption" warning from the kernel
    with tempfile.TemporaryDirectory(prefix="tinyserve-kernel-") as tmp:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=str(Path(tmp) / "k"),
                           connection_file=str(Path(tmp) / "kernel.json"))
        client = ProgressClient(nb, km=km, timeout=TIMEOUT_PER_CELL, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})   # the notebook's own folder
        try:
            client.execute()
        except CellExecutionError as e:
            ok = False
            plain = re.sub(r"\x1b\[[0-9;]*m", "", str(e))      # the traceback without terminal colour codes
            print(f"lesson {n} FAILED:\n{plain[-3000:]}")
        finally:
            if km.has_kernel:             # a kernel manager we made is ours to stop (nbclient stops only its own)
                km.shutdown_kernel(now=True)
    nbformat.write(nb, out / path.name)
    print(f"   executed in {time.perf_counter() - t0:.0f} s -> {(out / path.name).relative_to(ROOT)}")
    return ok


USAGE = """usage: run_lesson.py [N | all] [--ledger FILE.json]
       run_lesson.py --compare QUIET.json BUSY.json"""


def main(argv: list[str] | None = None) -> int:
    # a SIGTERM (timeout, kill) becomes SystemExit, so nbclient shuts the kernel down instead of orphaning it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--compare"]:
        if len(args) != 3:
            print(USAGE)
            return 2
        ledgers, threads = [], []
        for path in args[1:]:
            try:
                data = json.loads(Path(path).read_text())
                ledgers.append(data["verdicts"])
                threads.append(data.get("threads"))
            except (OSError, ValueError, KeyError, TypeError) as e:
                print(f"--compare: {path} is not a ledger written by --ledger ({type(e).__name__}: {e})")
                return 2
        table, differ = compare(*ledgers)
        if all(threads):         # each run's floors divide by a probe on its own thread count (course.fit_threads)
            print(f"threads: {threads[0]} in {args[1]}, {threads[1]} in {args[2]}")
        print(table)
        return 1 if differ else 0
    ledger_path = None
    if "--ledger" in args:
        i = args.index("--ledger")
        if i + 1 >= len(args):
            print(USAGE)
            return 2
        ledger_path = Path(args[i + 1])
        del args[i:i + 2]
    which = args[0] if args else "all"
    books = notebooks()
    if which != "all" and not which.isdigit():
        print(USAGE)
        return 2
    chosen = books if which == "all" else {int(which): books.get(int(which))}
    if None in chosen.values():
        print(f"no notebook for lesson {which}; have {sorted(books)}")
        return 1
    run_bw = None
    if which == "all":        # one run of the course: every lesson divides by the same probe (course.machine)
        os.environ.setdefault("TINYSERVE_COURSE_RUN", f"{os.getpid()}-{time.time():.0f}")
        sys.path.insert(0, str(ROOT))
        from tinyserve import course
        # one thread count for the whole run (the cores other programs leave free now): every lesson runs on it and
        # divides by a probe taken on it, so the ledger compares like with like
        os.environ.setdefault(course.THREADS_ENV, str(course.fit_threads().threads))
        m = course.machine()
        run_bw = {"bandwidth": m.bandwidth, "bandwidth_lo": m.bandwidth_lo, "bandwidth_hi": m.bandwidth_hi}
        print(f"== the course's one bandwidth for this run: {m.bandwidth / 1e9:.1f} GB/s "
              f"({m.bandwidth_lo / 1e9:.1f}-{m.bandwidth_hi / 1e9:.1f}) on {m.threads} thread(s); every lesson below "
              f"runs on {m.threads} and divides by it", flush=True)
    ledger: list[dict] = []
    results = {n: run(n, p, run_bw, ledger) for n, p in chosen.items()}
    failed = [n for n, ok in results.items() if not ok]
    if ledger_path is not None:
        ledger_path.parent.mkdir(parents=True, exist_ok=True)
        ledger_path.write_text(json.dumps({"bandwidth": run_bw, "threads": os.environ.get("TINYSERVE_THREADS"),
                                           "verdicts": ledger}, indent=1))
        print(f"ledger: {len(ledger)} verdicts -> {ledger_path}")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f" (lessons {failed})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
