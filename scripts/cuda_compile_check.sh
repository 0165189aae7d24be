#!/usr/bin/env bash
# Compile-only check of the CUDA kernels (csrc/*.cu) on a machine without a GPU.
#
#   scripts/cuda_compile_check.sh                 compile every csrc/*.cu with -c for each arch
#   scripts/cuda_compile_check.sh --install DIR   install nvcc from PyPI into DIR (pip --target)
#                                                 and print the nvcc path on stdout
#
# The compile uses setup.py's NVCC_FLAGS (without -shared) plus -c and -Werror all-warnings,
# one object per source and arch (CUDA_ARCHS, default "80 90"), in a scratch directory; nothing
# in the checkout changes. nvcc is $NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on PATH.
# The kernels include only <cuda_runtime.h> (no torch headers), so the PyPI toolkit is enough:
# nvidia-cuda-nvcc with its nvvm, crt and runtime packages (about 125 MB to download, 320 MB
# installed; CUDA 12's nvidia-cuda-nvcc-cu12 wheels hold only ptxas, hence CUDA 13). Pin
# another release with CUDA_PYPI_VERSION; the four packages must share one version.
# Exit status: 0 compiled (or installed), 1 a compile or the install failed, 2 no nvcc or bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
CUDA_PYPI_VERSION=${CUDA_PYPI_VERSION:-13.5.37}

if [[ ${1:-} == --install ]]; then
  dir=${2:?"--install needs a directory"}
  pkgs=(nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt nvidia-cuda-runtime)
  "$PYTHON" -m pip install -q --disable-pip-version-check --no-deps --target "$dir" \
    "${pkgs[@]/%/==$CUDA_PYPI_VERSION}" >&2 || exit 1
  nvcc=$(find "$dir" -path '*/bin/nvcc' -type f | head -n 1)
  [[ -n $nvcc ]] || { echo "cuda_compile_check: no bin/nvcc under $dir" >&2; exit 1; }
  chmod +x "$nvcc"
  echo "$nvcc"
  exit 0
elif [[ $# -gt 0 ]]; then
  echo "usage: $0 [--install DIR]" >&2
  exit 2
fi

nvcc=${NVCC:-}
if [[ -z $nvcc && -n ${CUDA_HOME:-} && -x $CUDA_HOME/bin/nvcc ]]; then nvcc=$CUDA_HOME/bin/nvcc; fi
nvcc=${nvcc:-$(command -v nvcc || true)}
[[ -n $nvcc && -x $nvcc ]] || { echo "cuda_compile_check: no nvcc (set NVCC, CUDA_HOME or PATH)" >&2; exit 2; }

# setup.py owns the flags: read its NVCC_FLAGS literal, drop -shared (no link step here)
read -r -a flags < <(sed -n 's/^NVCC_FLAGS = //p' setup.py |
  "$PYTHON" -c 'import ast, sys; print(" ".join(f for f in ast.literal_eval(sys.stdin.read()) if f != "-shared"))')
out=$(mktemp -d "${TMPDIR:-/tmp}/cuda_compile_check.XXXXXX")
trap 'rm -rf "$out"' EXIT
echo "cuda_compile_check: $("$nvcc" --version | tail -n 1)"
failed=0
for src in csrc/*.cu; do
  for arch in ${CUDA_ARCHS:-80 90}; do
    obj=$out/$(basename "$src" .cu).sm_$arch.o
    start=$(date +%s)
    if "$nvcc" "${flags[@]}" -Werror all-warnings "-gencode=arch=compute_$arch,code=sm_$arch" -c "$src" -o "$obj"; then
      echo "cuda_compile_check: OK   $src sm_$arch ($(stat -c %s "$obj") bytes, $(($(date +%s) - start)) s)"
    else
      echo "cuda_compile_check: FAIL $src sm_$arch" >&2
      failed=1
    fi
  done
done
exit $failed
