"""Which instruction set the kernels are built for: chosen once, at import, from this CPU's features.

Your CPU is not mine. An int8 matmul is a pile of byte multiply-adds, and each instruction set multiplies bytes its
own way (kernels/int8_dot.py); the register file decides how large a tile of accumulators can stay in registers:

    variant      CPUs (docs/performance.md names them)   int8 dot product               vector  registers
    avx512vnni   x86 with AVX-512 VNNI                   vpdpbusd zmm: 64 MACs, 1 op    64 B    32
    avxvnni      x86 with AVX-VNNI (256-bit)             vpdpbusd ymm: 32 MACs, 1 op    32 B    16
    avx2         x86 with AVX2 and FMA                   vpmaddubsw + vpmaddwd (+ sign  32 B    16
                                                         trick): 32 MACs, 4 ops
    neon         arm64 with the dot-product extension    sdot: 16 MACs, 1 op            16 B    32
    generic      anything else                           plain loops LLVM vectorises    16 B    16

TINYSERVE_KERNELS=<variant> forces one the CPU can run (the tests run every such variant; `make bench` can measure
one). A forced variant below the CPU's own is compiled for exactly its features (the AVX-512 ones switched off),
so it runs the instructions it would run on such a CPU, at this CPU's clock. Each variant keeps its compiled
kernels in a cache folder of its own (<NUMBA_CACHE_DIR>/<variant>-<hash of the kernel sources>): Numba's cache
does not know which tile a kernel was built with, and the first run compiles only the chosen variant.

This module must be imported before numba (kernels/__init__.py does): a forced variant sets NUMBA_CPU_FEATURES.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import llvmlite.binding as llvm


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    needs: tuple[str, ...]     # LLVM feature names the CPU must have
    int8_dot: str              # how it multiplies bytes, for the reports
    vector_bytes: int          # one SIMD register
    registers: int             # SIMD registers the tiles may fill
    arch: str                  # "x86" | "arm64" | "any"


VARIANTS = {v.name: v for v in (
    Variant("avx512vnni", ("avx512f", "avx512bw", "avx512vnni"), "vpdpbusd zmm", 64, 32, "x86"),
    Variant("avxvnni", ("avx2", "fma", "avxvnni"), "vpdpbusd ymm", 32, 16, "x86"),
    Variant("avx2", ("avx2", "fma"), "vpmaddubsw + vpmaddwd", 32, 16, "x86"),
    Variant("neon", ("neon", "dotprod"), "sdot", 16, 32, "arm64"),
    Variant("generic", (), "plain loops", 16, 16, "any"),
)}
ORDER = tuple(VARIANTS)        # fastest first: the default is the first one the CPU has

# features a forced x86 variant must not let LLVM use (it would otherwise vectorise the rest of the code with them)
_WIDE = ("avx512", "avx10", "evex512", "amx")
_ABOVE = {"avxvnni": _WIDE, "avx2": _WIDE + ("avxvnni", "avxifma", "avxneconvert")}


def _arch() -> str:
    m = platform.machine().lower()
    return "x86" if m in ("x86_64", "amd64", "i686", "i386") else "arm64" if m in ("arm64", "aarch64") else m


ARCH = _arch()     # "x86" | "arm64" | what the machine says (kernels/spin.py picks its instructions by it too)


# arm64 Linux: LLVM's host features come from a short list of /proc/cpuinfo's (neon, fp-armv8, crc, lse, aes, sha2,
# sve...) and never include dotprod; the kernel's AT_HWCAP bits say what the CPU has (asm/hwcap.h)
_HWCAP_BITS = {"fp-armv8": 1 << 0, "neon": 1 << 1, "dotprod": 1 << 20}


def _arm64_hwcaps() -> dict[str, bool]:
    if ARCH != "arm64" or platform.system() != "Linux":
        return {}
    import ctypes
    try:
        getauxval = ctypes.CDLL(None).getauxval
    except (OSError, AttributeError):
        return {}
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    hwcap = getauxval(16)                                    # AT_HWCAP
    return {f: True for f, bit in _HWCAP_BITS.items() if hwcap & bit}


def host_features() -> dict[str, bool]:
    return {**dict(llvm.get_host_cpu_features()), **_arm64_hwcaps()}


def supported(features: dict[str, bool] | None = None, arch: str | None = None) -> list[str]:
    """The variants this CPU can run, fastest first."""
    features = host_features() if features is None else features
    arch = ARCH if arch is None else arch
    return [v.name for v in VARIANTS.values()
            if v.arch in (arch, "any") and all(features.get(f, False) for f in v.needs)]


def choose(env: dict | None = None, features: dict[str, bool] | None = None, arch: str | None = None) -> str:
    """The variant to build: TINYSERVE_KERNELS if set (it must be one this CPU runs), else the fastest supported.
    TINYSERVE_PORTABLE_KERNELS=1 (older name) means generic."""
    env = os.environ if env is None else env
    can = supported(features, arch)
    forced = env.get("TINYSERVE_KERNELS", "").strip().lower()
    if not forced and env.get("TINYSERVE_PORTABLE_KERNELS", "0") not in ("", "0"):
        forced = "generic"
    if not forced:
        return can[0]
    if forced not in VARIANTS:
        raise ValueError(f"TINYSERVE_KERNELS={forced!r}: choose one of {', '.join(ORDER)}")
    if forced not in can:
        raise ValueError(f"TINYSERVE_KERNELS={forced}: this CPU cannot run it (it runs {', '.join(can)})")
    return forced


def forced_features(name: str, features: dict[str, bool] | None = None) -> str | None:
    """The NUMBA_CPU_FEATURES string that compiles for `name` on this CPU (None: the CPU's own features)."""
    if name == "neon":                     # LLVM's own host features lack dotprod (see _arm64_hwcaps): pin ours
        features = host_features() if features is None else features
        return ",".join(("+" if on else "-") + f for f, on in sorted(features.items()))
    if name not in _ABOVE:
        return None
    features = host_features() if features is None else features
    off = _ABOVE[name]
    return ",".join(("-" if (not on or f.startswith(off)) else "+") + f for f, on in sorted(features.items()))


NAME = choose()
KERNELS = VARIANTS[NAME]
FORCED_FEATURES = forced_features(NAME)


def describe() -> str:
    """One line for the CLI, `make bench` and lesson 7, e.g. 'kernels: avx2 (int8 via vpmaddubsw + vpmaddwd)'."""
    forced = " (forced)" if NAME != supported()[0] else ""
    return f"kernels: {NAME}{forced} (int8 via {KERNELS.int8_dot})"


def vectors_per_block(block: int = 16, element_bytes: int = 4) -> int:
    """SIMD registers one block of `block` 32-bit accumulators takes: 1 zmm, 2 ymm, 4 NEON q registers."""
    return max(1, block * element_bytes // KERNELS.vector_bytes)


def plan_subtiles(R: int, C: int, extra: int, registers: int | None = None, v: int | None = None) -> tuple[int, int]:
    """The largest sub-tile (r, c) of an R x C tile of 16-lane blocks whose accumulators stay in registers:
    v*r*c accumulators + v*c weight vectors (held for r > 1 rows; streamed through one register for r = 1) +
    `extra` (broadcasts, constants, temporaries) <= the register file. Ties go to the squarer tile (fewer loads
    per multiply-add). On AVX-512 every tile the kernels use fits whole; on AVX2's 16 ymm a 4 x 4 tile runs as
    four 2 x 2 passes over the input instead of spilling accumulators to the stack on every step."""
    registers = KERNELS.registers if registers is None else registers
    v = vectors_per_block() if v is None else v
    best = (1, 1)
    for r in range(1, R + 1):
        for c in range(1, C + 1):
            need = v * r * c + (v * c if r > 1 else 1) + extra
            if need <= registers and (r * c, -abs(r - c)) > (best[0] * best[1], -abs(best[0] - best[1])):
                best = (r, c)
    return best
