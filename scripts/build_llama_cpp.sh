#!/usr/bin/env bash
# Build llama.cpp from source, CPU only, as the measuring peer for picompile's GGUF benchmarks
# (benchmarks/bench_gguf.py, benchmarks/llama_cpp.py). llama.cpp is never a dependency of
# picompile and nothing built here is committed: everything lives under ~/.cache/picompile/llama.cpp.
#
# Source: the llama-cpp-python sdist on PyPI vendors llama.cpp (vendor/llama.cpp), so pip alone
# fetches it (`pip download --no-binary :all: --no-deps llama-cpp-python==VERSION`).
#
# Usage:  scripts/build_llama_cpp.sh            # build (or finish / no-op if already built)
#         LLAMA_CPP_PY_VERSION=0.3.36 JOBS=2 scripts/build_llama_cpp.sh
#         scripts/build_llama_cpp.sh --force    # wipe this version's build dir and rebuild
#
# Needs a C/C++ compiler, make and cmake >= 3.14. If cmake or the compiler is missing the script
# installs them: `apt-get install -y build-essential cmake` when run as root with apt-get, else
# `pip install cmake` for cmake (the compiler must then be installed by hand).
# Takes ~10-20 minutes on 2 shared cores; runs niced (nice -n 10) with JOBS=2 parallel jobs.
#
# Result (printed at the end):
#   ~/.cache/picompile/llama.cpp/current/bin/{llama-bench,llama-perplexity,llama-quantize,llama-tokenize,llama-simple}
#   ~/.cache/picompile/llama.cpp/noamx.so   LD_PRELOAD shim from scripts/llama_cpp_noamx.c
# Always run the binaries as
#   LD_PRELOAD=~/.cache/picompile/llama.cpp/noamx.so OMP_WAIT_POLICY=passive llama-bench -t THREADS ...
# The shim refuses the AMX tile permission (Xeons here advertise AMX but its tile instructions
# fault: llama-bench exits 139); it is harmless where there is no AMX. OMP_WAIT_POLICY=passive
# because spinning OpenMP threads collapse on shared cores (2.7 tok/s instead of 45).
# The build uses -DGGML_NATIVE=ON: the binaries are for this machine's CPU only.
set -euo pipefail

VERSION="${LLAMA_CPP_PY_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
ROOT="${PICOMPILE_LLAMA_CPP_DIR:-$HOME/.cache/picompile/llama.cpp}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
SRC="$ROOT/src-$VERSION"
BUILD="$ROOT/build-$VERSION"
TOOLS=(llama-bench llama-perplexity llama-quantize llama-tokenize llama-simple llama-server)

if [[ "${1:-}" == "--force" ]]; then rm -rf "$BUILD"; fi
mkdir -p "$ROOT"

say() { echo "build_llama_cpp: $*"; }

# --- toolchain ---------------------------------------------------------------------------------
if ! command -v cc >/dev/null || ! command -v c++ >/dev/null || ! command -v make >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        say "installing build-essential with apt-get"
        apt-get update -q && apt-get install -y -q build-essential
    else
        say "error: a C/C++ compiler and make are needed (e.g. apt-get install build-essential)"; exit 2
    fi
fi
if ! command -v cmake >/dev/null; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        say "installing cmake with apt-get"
        apt-get update -q && apt-get install -y -q cmake
    else
        say "installing cmake with pip"
        python -m pip install -q cmake
    fi
fi

# --- the AMX-refusing shim (cheap: rebuilt when its source is newer) ---------------------------
SHIM="$ROOT/noamx.so"
if [[ ! -f "$SHIM" || "$HERE/llama_cpp_noamx.c" -nt "$SHIM" ]]; then
    cc -O2 -Wall -shared -fPIC -o "$SHIM.tmp" "$HERE/llama_cpp_noamx.c" -ldl
    mv "$SHIM.tmp" "$SHIM"
fi

# --- which llama.cpp: the sdist pins its submodule's commit (.git/modules/vendor/llama.cpp/HEAD) -----
TARBALL="$ROOT/sdist/llama_cpp_python-$VERSION.tar.gz"
write_source_line() {  # $BUILD/llama.cpp-source.txt, read by benchmarks/llama_cpp.py for the records
    local commit="unknown"
    if [[ -f "$TARBALL" ]]; then
        commit=$(tar -xzf "$TARBALL" -O "llama_cpp_python-$VERSION/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null \
                 | head -c 12) || commit="unknown"
    fi
    mkdir -p "$BUILD"
    echo "llama.cpp ${commit:-unknown} (vendored by llama-cpp-python $VERSION)" > "$BUILD/llama.cpp-source.txt"
}

# --- already built? ----------------------------------------------------------------------------
all_built() { for t in "${TOOLS[@]}"; do [[ -x "$BUILD/bin/$t" ]] || return 1; done; }
if all_built; then
    ln -sfn "build-$VERSION" "$ROOT/current"
    say "already built (llama-cpp-python $VERSION); nothing to do"
else
    # --- source: the sdist's vendored llama.cpp ------------------------------------------------
    if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
        DL="$ROOT/sdist"
        mkdir -p "$DL"
        if [[ ! -f "$TARBALL" ]]; then
            say "downloading the llama-cpp-python $VERSION sdist from PyPI"
            python -m pip download -q --no-binary :all: --no-deps -d "$DL" "llama-cpp-python==$VERSION"
        fi
        say "unpacking vendor/llama.cpp into $SRC"
        rm -rf "$SRC.tmp" && mkdir -p "$SRC.tmp"
        tar -xzf "$TARBALL" -C "$SRC.tmp" --strip-components=3 "llama_cpp_python-$VERSION/vendor/llama.cpp"
        rm -rf "$SRC" && mv "$SRC.tmp" "$SRC"
    fi

    # --- configure and build -------------------------------------------------------------------
    # (configured again where an earlier build left llama-server out)
    if [[ ! -f "$BUILD/CMakeCache.txt" ]] || grep -q '^LLAMA_BUILD_SERVER:BOOL=OFF' "$BUILD/CMakeCache.txt"; then
        say "configuring (Release, CPU only, GGML_NATIVE=ON)"
        nice -n 10 cmake -S "$SRC" -B "$BUILD" \
            -DCMAKE_BUILD_TYPE=Release \
            -DGGML_NATIVE=ON -DGGML_CPU=ON -DGGML_OPENMP=ON \
            -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_BLAS=OFF \
            -DBUILD_SHARED_LIBS=OFF \
            -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
            -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON \
            -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF
    fi
    say "building ${TOOLS[*]} with -j$JOBS (niced; minutes)"
    nice -n 10 cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TOOLS[@]}"
    all_built || { say "error: some tools are missing after the build"; exit 1; }
    ln -sfn "build-$VERSION" "$ROOT/current"
fi
[[ -f "$BUILD/llama.cpp-source.txt" ]] || write_source_line

say "$(cat "$BUILD/llama.cpp-source.txt"): binaries in $ROOT/current/bin:"
for t in "${TOOLS[@]}"; do echo "  $ROOT/current/bin/$t"; done
say "AMX shim: $SHIM"
say "run as: LD_PRELOAD=$SHIM OMP_WAIT_POLICY=passive $ROOT/current/bin/llama-bench -t 2 -m FILE.gguf"
