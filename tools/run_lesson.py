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


def run(n: int, paths: list[Path]) -> bool:
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
            for r in verdicts:
                load = "" if "busy" not in r else (" [busy %.1f cores]" % r.get("busy_cores", 0.0) if r["busy"] else " [quiet]")
                print(f"     {'held' if r['holds'] else 'FAILED':6s} {r.get('kind', 'prediction'):11s}"
                      f"{r['finding'].split(':')[0][:90]}{load}")
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


def main() -> int:
    # a SIGTERM (timeout, kill) becomes SystemExit, so nbclient shuts the kernel down instead of orphaning it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    books = notebooks()
    chosen = books if which == "all" else {int(which): books.get(int(which))}
    if which == "all":        # one run of the course: every lesson divides by the same probe (course.machine)
        os.environ.setdefault("TINYSERVE_COURSE_RUN", f"{os.getpid()}-{time.time():.0f}")
    if None in chosen.values():
        print(f"no notebook for lesson {which}; have {sorted(books)}")
        return 1
    results = {n: run(n, p) for n, p in chosen.items()}
    failed = [n for n, ok in results.items() if not ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f" (lessons {failed})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
