#!/bin/sh
# Build ik-llama-cpp-python (pinned) from its sdist into a venv of its own: .venv-ik.
# The prebuilt wheel is AVX2-only; ik_llama.cpp's fast paths (AVX-512, VNNI) need a native build. Takes 8-15 minutes on
# 2 cores (it compiles ik_llama.cpp and its llama-quantize); the compiler's progress is shown.
# Usage: tools/peers/setup_ik.sh [venv-dir] [python]
set -eu
VENV=${1:-.venv-ik}
PY=${2:-python3}
VERSION=0.1.5
STAMP="$VENV/.installed-$VERSION"
if [ -f "$STAMP" ]; then exit 0; fi
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# On a CPU with AMX the native (-march=native) build of llama.cpp segfaults in llama_decode (see setup_llama.sh):
# keep every other native instruction (AVX-512, VNNI) but switch the AMX ones off.
CMAKE_ARGS="${CMAKE_ARGS:-} -DGGML_NATIVE=ON"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_C_FLAGS='$NOAMX' -DCMAKE_CXX_FLAGS='$NOAMX'"
    echo "setup_ik: this CPU has AMX; building ik_llama.cpp with $NOAMX (the AMX build crashes in llama_decode)"
fi
# The worker's K/V cache is q8_0 (or f16), which ik's flash attention supports without its q4_0/q4_1/iq4_nl cache
# kernels: leaving them out saves a large share of the compile.
CMAKE_ARGS="$CMAKE_ARGS -DGGML_IQK_FA_ALL_QUANTS=OFF"
export CMAKE_ARGS
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
echo "setup_ik: building ik-llama-cpp-python==$VERSION from its sdist into $VENV (8-15 min on 2 cores) ..."
start=$(date +%s)
# The sdist, unpacked in the venv: it lacks common/cmake/build-info-gen-cpp.cmake, the script the build runs to write
# common/build-info.cpp from its template (llama-quantize links it), so that file is written here and the script is
# an empty one; a build folder in the venv too, so a build that stops half-way resumes where it stopped.
SRC="$VENV/src/ik_llama_cpp_python-$VERSION"
if [ ! -d "$SRC" ]; then
    mkdir -p "$VENV/src"
    "$VENV/bin/python" -m pip download --quiet --no-deps --no-binary :all: "ik-llama-cpp-python==$VERSION" \
        -d "$VENV/src"
    tar xzf "$VENV/src/ik_llama_cpp_python-$VERSION.tar.gz" -C "$VENV/src"
fi
COMMON="$SRC/vendor/ik_llama.cpp/common"
if [ ! -f "$COMMON/build-info.cpp" ]; then
    sed -e 's|@BUILD_NUMBER@|0|' -e "s|@BUILD_COMMIT@|ik-llama-cpp-python-$VERSION|" -e 's|@BUILD_COMPILER@|cc|' \
        -e "s|@BUILD_TARGET@|$(uname -m)|" "$COMMON/build-info.cpp.in" > "$COMMON/build-info.cpp"
fi
if [ ! -f "$COMMON/cmake/build-info-gen-cpp.cmake" ]; then
    mkdir -p "$COMMON/cmake"
    echo "# Written by setup_ik.sh: the sdist lacks this script; build-info.cpp is written from its template." \
        > "$COMMON/cmake/build-info-gen-cpp.cmake"
fi
LOG="$VENV/build.log"
status=0
"$VENV/bin/python" -m pip install -v --no-cache-dir --config-settings=build-dir="$VENV/build" "$SRC" numpy \
    > "$LOG" 2>&1 &
pip_pid=$!
tail -n +1 -f --pid=$pip_pid "$LOG" | sed -un 's/^ *\(\[[0-9]*\/[0-9]*\]\).* -o \([^ ]*\).*/  \1 \2/p; s/^ *\(Successfully installed.*\)/  \1/p'
wait $pip_pid || status=$?
if [ $status -ne 0 ]; then
    echo "setup_ik: pip failed (exit $status); the last lines of $LOG:"; tail -n 30 "$LOG"; exit $status
fi
# the package must load its library (as ik_worker.py does: libggml.so first, libllama.so has no rpath to it) and
# ship its quantizer (bench-peers makes IQ4_KS with it)
"$VENV/bin/python" -c "import sys; sys.path.insert(0, '$(dirname "$0")'); import ik_worker; ik_worker.preload_ggml()
import ik_llama_cpp as ik; from ik_llama_cpp import _ctypes_api; q = ik.find_quantize_bin()
assert q, 'no llama-quantize in the package'; print('setup_ik: ik_llama_cpp', ik.__version__, 'with', q)"
echo "setup_ik: done in $(( $(date +%s) - start )) s"
touch "$STAMP"
