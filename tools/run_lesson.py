#!/usr/bin/env python
"""Execute a lesson notebook headless: `make lesson-N` (or `all`).

The executed copy and its figures go to build/lesson-NN/; the findings the notebook recorded are printed.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_PER_CELL = 900


def notebooks() -> dict[int, Path]:
    return {int(p.parent.name[:2]): p for p in sorted((ROOT / "lessons").glob("[0-9][0-9]_*/lesson.ipynb"))}


def run(n: int, path: Path) -> bool:
    out = ROOT / "build" / f"lesson-{n:02d}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "findings.jsonl").unlink(missing_ok=True)
    os.environ["TINYSERVE_BUILD"] = str(out)
    os.environ.setdefault("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    print(f"== lesson {n}: {path.relative_to(ROOT)} ({len(nb.cells)} cells)", flush=True)
    t0 = time.perf_counter()
    client = NotebookClient(nb, timeout=TIMEOUT_PER_CELL, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}})
    ok = True
    try:
        client.execute()
    except CellExecutionError as e:
        ok = False
        print(f"lesson {n} FAILED:\n{str(e)[-3000:]}")
    nbformat.write(nb, out / "lesson.ipynb")
    print(f"   executed in {time.perf_counter() - t0:.0f} s -> {(out / 'lesson.ipynb').relative_to(ROOT)}")
    findings = out / "findings.jsonl"
    if findings.exists():
        print("   what the lesson found:")
        for line in findings.read_text().splitlines():
            print("    -", json.loads(line)["finding"])
    figures = sorted(out.glob("*.png"))
    if figures:
        print("   figures:", ", ".join(str(f.relative_to(ROOT)) for f in figures))
    return ok


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    books = notebooks()
    chosen = books if which == "all" else {int(which): books.get(int(which))}
    if None in chosen.values():
        print(f"no notebook for lesson {which}; have {sorted(books)}")
        return 1
    results = {n: run(n, p) for n, p in chosen.items()}
    failed = [n for n, ok in results.items() if not ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f" (lessons {failed})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
