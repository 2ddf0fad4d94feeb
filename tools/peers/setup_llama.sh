#!/bin/sh
# Build llama-cpp-python (pinned) from source into a venv of its own: .venv-llama.
# Takes ~12 minutes on 2 cores (it compiles llama.cpp); the compiler's progress is shown.
# Usage: tools/peers/setup_llama.sh [venv-dir] [python]
set -eu
VENV=${1:-.venv-llama}
PY=${2:-python3}
VERSION=0.3.36
STAMP="$VENV/.installed-$VERSION"
if [ -f "$STAMP" ]; then exit 0; fi
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# On a CPU with AMX the native (-march=native) build of llama.cpp segfaults in llama_decode:
# keep every other native instruction (AVX-512, VNNI) but switch the AMX ones off.
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
    NOAMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_C_FLAGS='$NOAMX' -DCMAKE_CXX_FLAGS='$NOAMX'"
    echo "setup_llama: this CPU has AMX; building llama.cpp with $NOAMX (the AMX build crashes in llama_decode)"
fi
# The multimodal library (mtmd, ~30 % of the objects) is loaded only for image chat: skip it.
CMAKE_ARGS="${CMAKE_ARGS:-} -DLLAVA_BUILD=OFF"
export CMAKE_ARGS
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
echo "setup_llama: building llama-cpp-python==$VERSION from source into $VENV (~12 min on 2 cores) ..."
start=$(date +%s)
# -v streams ninja's "[n/m] compiler ... -o object" lines: show them as "[n/m] object", so the build shows progress
# without pages of compiler flags. The full log is kept for when it fails.
LOG="$VENV/build.log"
status=0
"$VENV/bin/python" -m pip install -v --no-cache-dir "llama-cpp-python==$VERSION" numpy > "$LOG" 2>&1 &
pip_pid=$!
tail -n +1 -f --pid=$pip_pid "$LOG" | sed -un 's/^ *\(\[[0-9]*\/[0-9]*\]\).* -o \([^ ]*\).*/  \1 \2/p; s/^ *\(Successfully installed.*\)/  \1/p'
wait $pip_pid || status=$?
if [ $status -ne 0 ]; then
    echo "setup_llama: pip failed (exit $status); the last lines of $LOG:"; tail -n 30 "$LOG"; exit $status
fi
"$VENV/bin/python" -c "import llama_cpp; print('setup_llama: llama_cpp', llama_cpp.__version__)"
echo "setup_llama: done in $(( $(date +%s) - start )) s"
touch "$STAMP"
