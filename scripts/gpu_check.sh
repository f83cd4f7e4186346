#!/usr/bin/env bash
# GPU acceptance check for picompile. Run from the repository root on a machine with one NVIDIA GPU
# (no network needed), e.g.:  bash scripts/gpu_check.sh
# Needs: the NVIDIA driver (nvidia-smi, libcuda), the CUDA toolkit (nvcc; CUDA_PATH or /usr/local/cuda)
# and the Python environment of the repository (apache-tvm 0.27, numpy, pytest). Takes a few minutes.
# Exits non-zero if any check fails.
set -euo pipefail

cd "$(dirname "$0")/.."
export CUDA_PATH="${CUDA_PATH:-/usr/local/cuda}"  # the nvcc on PATH may be a wrapper script
PYTHON="${PYTHON:-python}"
status=0

section() { printf '\n== %s ==\n' "$*"; }

section "GPU"
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: run this on a machine with an NVIDIA GPU"; exit 1; }
nvidia-smi -L
"$CUDA_PATH/bin/nvcc" --version | tail -n 1

section "TVM sees the GPU"
# Without this the kernel tests below would all skip (they need tvm.cuda(0).exist) and pass vacuously.
"$PYTHON" - <<'PY'
import tvm
dev = tvm.cuda(0)
if not dev.exist:
    raise SystemExit("tvm.cuda(0) does not exist: check the driver, libcuda.so.1 and libcudart.so.13")
print(f"tvm.cuda(0): {dev.device_name}, compute capability {dev.compute_version}")
PY

section "CUDA kernels: builds for sm_75/80/89/90 + numeric checks on this GPU"
timeout 420 "$PYTHON" -m pytest -q -rs tests/test_cuda_kernels.py || status=1

# ==============================================================================================
# WHOLE-MODEL CHECKS: add them below (compile a small model with its hot FFN neurons on the GPU,
# run it, compare with the CPU build / the reference). Keep the total run under 8 minutes and set
# status=1 on failure, like the kernel tests above.
# ==============================================================================================

section "result"
if [ "$status" -ne 0 ]; then
    echo "GPU check FAILED"
    exit "$status"
fi
echo "GPU check passed"
