"""Build llama.cpp's `llama-server` from the llama.cpp source that the llama-cpp-python sdist vendors, once.

    python tools/peers/build_llama_server.py                 # -> <cache>/llama-server-<version>/bin/llama-server
    python tools/peers/build_llama_server.py --print-cmake   # show the cmake command lines, build nothing
    python tools/peers/build_llama_server.py --jobs 2 --prefix DIR

Why this source: bench-peers measures llama.cpp through llama-cpp-python (setup_llama.sh pins its version), so the
serving peer is built from the very llama.cpp that release vendors: one llama.cpp in the whole comparison. A fresh
machine has Python, pip, gcc and make only, so cmake comes from PyPI into a small venv of the build's own (the
"Unix Makefiles" generator needs nothing more). The binary is linked statically against ggml and llama, so the
cache directory holds one self-contained executable; a stamp beside it records what it was built from, and a second
run with the same settings does nothing (`make peer-server` calls this every time).

Standard library only: it runs under any Python 3.11, before any venv exists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

VERSION = "0.3.36"          # llama-cpp-python's release; keep in step with setup_llama.sh
CMAKE_REQ = "cmake>=3.28,<5"
# On a CPU with AMX the native (-march=native) build crashes in llama_decode: keep every other native instruction
# (AVX-512, VNNI) and switch the AMX ones off, as setup_llama.sh does for the Python binding.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The server alone: no tests, examples or web UI (the UI would need npm, or a download at build time), no HTTPS
# (the bench talks to it on loopback). LLAMA_CURL no longer exists in this llama.cpp (downloading models moved to its
# own HTTP client); it is passed anyway, OFF, so an older vendored tree also builds without libcurl.
FIXED_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "BUILD_SHARED_LIBS": "OFF",
    "GGML_NATIVE": "ON",
    "LLAMA_CURL": "OFF",
    "LLAMA_OPENSSL": "OFF",
    "LLAMA_BUILD_SERVER": "ON",
    "LLAMA_BUILD_TOOLS": "ON",
    "LLAMA_BUILD_TESTS": "OFF",
    "LLAMA_BUILD_EXAMPLES": "OFF",
    "LLAMA_BUILD_UI": "OFF",
    "LLAMA_USE_PREBUILT_UI": "OFF",
}


def default_prefix(version: str = VERSION) -> Path:
    """Beside the model's other cached files (tinyserve.weights.cache_dir: $TINYSERVE_CACHE or ~/.cache/tinyserve)."""
    base = Path(os.environ.get("TINYSERVE_CACHE", Path.home() / ".cache" / "tinyserve"))
    return base / f"llama-server-{version}"


def cpu_has_amx(cpuinfo: str) -> bool:
    """True if /proc/cpuinfo's flags name amx_tile (a whole word: 'amx_tile', not e.g. 'amx_tile_x')."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags") and "amx_tile" in line.split(":", 1)[-1].split():
            return True
    return False


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything the build depends on; its key() is written to the stamp so a changed setting rebuilds."""
    version: str
    options: tuple[tuple[str, str], ...]       # -D NAME=VALUE, sorted
    jobs: int

    def key(self) -> str:
        """What identifies the binary (the job count does not change it)."""
        data = json.dumps({"version": self.version, "options": self.options}, sort_keys=True)
        return hashlib.sha256(data.encode()).hexdigest()[:16]


def make_plan(version: str = VERSION, cpuinfo: str = "", jobs: int | None = None,
              extra: list[str] | None = None) -> Plan:
    """The cmake options for this CPU: the fixed ones, the AMX switch-off where needed, and NAME=VALUE extras."""
    opts = dict(FIXED_OPTIONS)
    if cpu_has_amx(cpuinfo):
        opts["CMAKE_C_FLAGS"] = opts["CMAKE_CXX_FLAGS"] = NO_AMX
    for item in extra or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not name.replace("_", "").isalnum():
            raise ValueError(f"--cmake-option wants NAME=VALUE (e.g. GGML_NATIVE=OFF), got {item!r}")
        opts[name] = value
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be at least 1, got {jobs}")
    return Plan(version, tuple(sorted(opts.items())), jobs or os.cpu_count() or 1)


def cmake_commands(plan: Plan, cmake: str, src: Path, build: Path) -> list[list[str]]:
    """Configure, then build the one target."""
    configure = [cmake, "-S", str(src), "-B", str(build), "-G", "Unix Makefiles",
                 *(f"-D{k}={v}" for k, v in plan.options)]
    return [configure, [cmake, "--build", str(build), "--target", "llama-server", "-j", str(plan.jobs)]]


def is_built(prefix: Path, plan: Plan) -> bool:
    """The binary is there and its stamp says it was built with this plan."""
    stamp = prefix / "build-stamp.json"
    if not (prefix / "bin" / "llama-server").is_file() or not stamp.is_file():
        return False
    try:
        return json.loads(stamp.read_text()).get("key") == plan.key()
    except (OSError, ValueError):
        return False


def server_path(prefix: Path | None = None) -> Path:
    return (prefix or default_prefix()) / "bin" / "llama-server"


# --- the steps (each one a subprocess; the log says what ran) ------------------------------------------------------

def _run(cmd: list[str], log: Path, **kw) -> None:
    print("build_llama_server: " + " ".join(cmd[:6]) + (" ..." if len(cmd) > 6 else ""), flush=True)
    with open(log, "a") as f:
        f.write("\n$ " + " ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw).returncode
    if rc:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"build_llama_server: {cmd[0]} failed (exit {rc}); the end of {log}:\n" + "\n".join(tail))


def tools_venv(work: Path, python: str, log: Path) -> Path:
    """A venv with pip's cmake in it: the cmake to run (and its pip downloads the sdist)."""
    venv = work / "tools-venv"
    py = venv / "bin" / "python"
    if not (venv / "bin" / "cmake").is_file():
        if not py.is_file():
            _run([python, "-m", "venv", str(venv)], log)
        _run([str(py), "-m", "pip", "install", "--quiet", CMAKE_REQ], log)
    return venv


def fetch_source(venv: Path, work: Path, version: str, log: Path) -> Path:
    """The llama-cpp-python sdist (source only: --no-binary), unpacked; the vendored llama.cpp tree inside it."""
    top = work / f"llama_cpp_python-{version}"
    tree = top / "vendor" / "llama.cpp"
    if (tree / "CMakeLists.txt").is_file():
        return tree
    dl = work / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    _run([str(venv / "bin" / "python"), "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
          f"llama-cpp-python=={version}", "-d", str(dl)], log)
    archives = sorted(dl.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not archives:
        raise SystemExit(f"build_llama_server: pip downloaded no llama_cpp_python-{version}.tar.gz into {dl}")
    # the "data" filter refuses absolute paths and links out of the tree (Python >= 3.11.4 has it)
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
    with tarfile.open(archives[0]) as t:
        t.extractall(work, **safe)
    if not (tree / "CMakeLists.txt").is_file():
        raise SystemExit(f"build_llama_server: the sdist has no vendor/llama.cpp/CMakeLists.txt under {top}")
    return tree


def build(plan: Plan, prefix: Path, python: str) -> Path:
    prefix.mkdir(parents=True, exist_ok=True)
    work = prefix / "work"
    work.mkdir(exist_ok=True)
    log = prefix / "build.log"
    t0 = time.monotonic()
    venv = tools_venv(work, python, log)
    src = fetch_source(venv, work, plan.version, log)
    build_dir = work / "build"
    for cmd in cmake_commands(plan, str(venv / "bin" / "cmake"), src, build_dir):
        _run(cmd, log)
    exe = build_dir / "bin" / "llama-server"
    if not exe.is_file():
        raise SystemExit(f"build_llama_server: the build finished without {exe}; see {log}")
    out = server_path(prefix)
    out.parent.mkdir(exist_ok=True)
    shutil.copy2(exe, out.with_suffix(".tmp"))
    out.with_suffix(".tmp").replace(out)
    _run([str(out), "--version"], log)          # it starts: a binary for another CPU would die here, not in the bench
    (prefix / "build-stamp.json").write_text(json.dumps(
        {"key": plan.key(), **asdict(plan), "built": time.strftime("%Y-%m-%d %H:%M %Z"),
         "seconds": round(time.monotonic() - t0)}, indent=1) + "\n")
    # the sources and objects (~1 GB) are not needed any more: the binary is self-contained
    shutil.rmtree(work, ignore_errors=True)
    print(f"build_llama_server: {out} in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="build llama.cpp's llama-server from llama-cpp-python's sdist, once")
    ap.add_argument("--version", default=VERSION, help=f"llama-cpp-python release whose llama.cpp to build ({VERSION})")
    ap.add_argument("--prefix", type=Path, default=None, help="install directory (default: <cache>/llama-server-VER)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    ap.add_argument("--python", default=sys.executable, help="the Python that makes the cmake venv")
    ap.add_argument("--cmake-option", action="append", default=[], metavar="NAME=VALUE",
                    help="an extra -D option (repeatable), e.g. GGML_NATIVE=OFF")
    ap.add_argument("--print-cmake", action="store_true", help="print the cmake commands and the install path only")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    try:
        plan = make_plan(a.version, cpuinfo, a.jobs, a.cmake_option)
    except ValueError as e:
        print(f"build_llama_server: {e}", file=sys.stderr)
        return 2
    prefix = a.prefix or default_prefix(a.version)
    if a.print_cmake:
        work = prefix / "work"
        for cmd in cmake_commands(plan, "cmake", work / f"llama_cpp_python-{a.version}/vendor/llama.cpp",
                                  work / "build"):
            print(" ".join(cmd))
        print(server_path(prefix))
        return 0
    if is_built(prefix, plan):
        print(f"build_llama_server: {server_path(prefix)} is built (stamp {plan.key()})")
        return 0
    if cpu_has_amx(cpuinfo):
        print(f"build_llama_server: this CPU has AMX; building with {NO_AMX} (the AMX build crashes in llama_decode)")
    print(f"build_llama_server: building llama-server from llama-cpp-python=={a.version}'s llama.cpp into {prefix} "
          f"({plan.jobs} jobs; ~10-20 min on 2 cores); log: {prefix / 'build.log'}", flush=True)
    build(plan, prefix, a.python)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
