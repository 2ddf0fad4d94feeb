#!/usr/bin/env bash
# Run tinyserve's kernels (the arm64 `neon` variant) under qemu-user emulation on an x86_64 Debian 12 host.
# Idempotent: each setup step is skipped when already done. Run as root. Usage:
#   bash tools/arm64_emulated_check.sh [SRC=/path/to/tinyserve checkout]   (default: the checkout this script is in)
# Env: ROOT (default /opt/arm64-root), STEPS ("setup import tests", default all), TEST_TIMEOUT (s, default 3600),
#      PATCH (optional: a patch applied with -p1 to the copied tree).
# Measured (2-core Xeon, qemu 7.2): debootstrap 4m43s, pip install 2m, import 4 s,
#   test_isa_variants 12 min (neon compile ~5.5 min, generic ~6 min), test_quant 3 min, test_kernels 2m49s.
set -euo pipefail
SRC=${1:-$(cd "$(dirname "$0")/.." && pwd)}
ROOT=${ROOT:-/opt/arm64-root}
STEPS=${STEPS:-setup import tests}
TEST_TIMEOUT=${TEST_TIMEOUT:-3600}
WORK=/tmp/arm64-work                   # the copied tree, as the chroot sees it: $ROOT$WORK
t() { local s=$(date +%s); "$@"; echo "[time] $* : $(( $(date +%s) - s )) s" >&2; }
quiet() { while [ -e /tmp/tinyserve_quiet ]; do echo "waiting: /tmp/tinyserve_quiet exists" >&2; sleep 30; done; }
in_arm() { chroot "$ROOT" /usr/bin/env -i HOME=/root PATH=/opt/venv/bin:/usr/bin:/bin \
             PYTHONPATH=$WORK NUMBA_CACHE_DIR=/tmp/numba-cache PYTHONDONTWRITEBYTECODE=1 \
             ${ARM_ENV:-} nice -n 19 "$@"; }

setup() {
  command -v qemu-aarch64-static >/dev/null && command -v debootstrap >/dev/null || {
    apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user-static binfmt-support debootstrap; }
  # binfmt_misc lets the kernel run arm64 ELF files through qemu (flag F: no need to copy qemu into the chroot)
  mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
  [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64
  if [ ! -x "$ROOT/usr/bin/python3.11" ]; then
    quiet; t nice -n 19 debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
      bookworm "$ROOT" http://deb.debian.org/debian
  fi
  cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
  cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
  mountpoint -q "$ROOT/proc" || mount -t proc proc "$ROOT/proc"
  mountpoint -q "$ROOT/dev" || mount --bind /dev "$ROOT/dev"
  # qemu 7.2 (bookworm) passes the HOST's /proc/cpuinfo through (aarch64 emulation of it came in qemu 8.1), and
  # LLVM reads the CPU name and features on Linux/aarch64 from /proc/cpuinfo: without this LLVM sees no features
  # at all and tinyserve picks `generic`. Lay over it a Neoverse-N1 (Graviton 2) cpuinfo; qemu's default `max`
  # CPU runs everything it lists (AT_HWCAP ecfffffb includes asimddp = dotprod).
  mkdir -p /opt/arm64-fake
  [ -s /opt/arm64-fake/cpuinfo ] || for i in 0 1; do printf 'processor\t: %s\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs\nCPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n' $i; done > /opt/arm64-fake/cpuinfo
  grep -q asimddp "$ROOT/proc/cpuinfo" || mount --bind /opt/arm64-fake/cpuinfo "$ROOT/proc/cpuinfo"
  # Numba's `omp` threading layer needs libgomp (minbase has none: Numba falls back to `workqueue`, and the fused
  # decode step's spin barrier, which runs only under omp, is never exercised)
  [ -e "$ROOT/usr/lib/aarch64-linux-gnu/libgomp.so.1" ] || chroot "$ROOT" apt-get install -y -qq libgomp1
  if [ ! -x "$ROOT/opt/venv/bin/pytest" ]; then
    quiet; t chroot "$ROOT" /bin/sh -c 'python3 -m venv /opt/venv && nice -n 19 /opt/venv/bin/pip install -q --cert /etc/ssl/certs/ca-certificates.crt \
      "numpy>=2.0,<2.5" "numba>=0.61,<0.70" "tokenizers>=0.20,<0.24" "safetensors>=0.4,<0.9" "threadpoolctl>=3.1,<4" \
      "gguf>=0.10,<0.20" "tqdm>=4.60,<5" "pytest>=8,<10" "hypothesis>=6.100,<7"'
  fi
  # the tree under test, without the host's venv and caches
  rm -rf "$ROOT$WORK"; mkdir -p "$ROOT$WORK"
  (cd "$SRC" && tar --exclude=./.venv --exclude=./.numba_cache --exclude=./.git --exclude=./weights -cf - .) | tar -xf - -C "$ROOT$WORK"
  if [ -n "${PATCH:-}" ]; then patch -d "$ROOT$WORK" -p1 < "$PATCH"; fi
  mkdir -p "$ROOT/tmp/numba-cache"
  in_arm python -c 'import platform, numpy, numba, llvmlite, llvmlite.binding as l; print(platform.machine(), platform.python_version(), "numpy", numpy.__version__, "numba", numba.__version__, "llvmlite", llvmlite.__version__); print(l.get_host_cpu_name(), sorted(k for k,v in l.get_host_cpu_features().items() if v))'
}

import_check() {
  quiet; t in_arm python -c 'import tinyserve, tinyserve.kernels; from tinyserve.kernels import isa; print(isa.describe(), isa.supported())'
}

tests() {
  for f in tests/test_isa_variants.py tests/test_quant.py tests/test_kernels.py tests/test_decode_step.py; do
    quiet; echo "== $f" >&2
    t in_arm /bin/sh -c "cd $WORK && timeout $TEST_TIMEOUT python -m pytest -q -x -p no:cacheprovider $f -m 'not real'" || echo "FAILED: $f" >&2
  done
}

for s in $STEPS; do case $s in setup) setup;; import) import_check;; tests) tests;; esac; done
