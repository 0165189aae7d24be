#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh may need on a GPU machine without network into .whl/.
#
# That machine (Python 3.12, x86-64, CUDA torch) has no network; its image already holds
# torch, numpy, pyyaml, xxhash, pytest, hypothesis and pytest-timeout, but an image can
# change, and redis/hiredis are not in it. gpu_check.sh installs from .whl/ only what its
# Python lacks. Torch and numpy are never downloaded (the image's CUDA torch is the point).
#
#   scripts/gpu_wheels.sh            # once, on a machine with PyPI access (this one)
#   then, on the GPU machine, with .whl/ copied beside the tree:   bash scripts/gpu_check.sh
#
# .whl/ is ignored by git (/.whl/ in .gitignore) and travels only when `carry` names it.
# The whole tree that travels is capped at 64 MiB; this script reports both sizes and fails
# when the total would exceed 48 MiB (a margin for build outputs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python && -z ${PYTHON:-} ]] && PY=.venv/bin/python
DEST=.whl
PACKAGES=(pyyaml xxhash "pytest>=7" "hypothesis>=6" pytest-timeout "redis>=5" hiredis)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

rm -rf "$DEST"
mkdir -p "$DEST"
plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
# resolves the dependency closure for a cp312 manylinux target: pure wheels (py3-none-any)
# where they exist, cp312 manylinux builds for the compiled ones (pyyaml, xxhash, hiredis)
"$PY" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${plat_args[@]}" \
  -d "$DEST" "${PACKAGES[@]}"

# exactly one version per distribution (two would stop the install there)
dupes=$(ls "$DEST"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)
[[ -z $dupes ]] || { echo "gpu_wheels: several versions of: $dupes" >&2; exit 1; }

whl_bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
tree_bytes=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total=$((whl_bytes + tree_bytes))
ls -1 "$DEST"
printf 'gpu_wheels: %d wheels, %.1f MiB; tracked+untracked tree %.1f MiB; total %.1f MiB (cap 64 MiB)\n' \
  "$(ls "$DEST"/*.whl | wc -l)" "$(echo "$whl_bytes / 1048576" | bc -l)" \
  "$(echo "$tree_bytes / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if (( total > 48 * 1024 * 1024 )); then
  echo "gpu_wheels: over the 48 MiB margin: drop wheels or untracked files before carrying" >&2
  exit 1
fi
