# The two commands of the README. Both create .venv when it is absent and
# reinstall only when pyproject.toml changed, so a second call starts at once.
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.dflop-installed
ARGS   ?=

.PHONY: run test test-fast bench gpu-check notebooks clean

$(STAMP): pyproject.toml
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --disable-pip-version-check -e '.[torch,dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/dflop run $(ARGS)

# Two workers, then alone what compares measured time with a prediction (each run lists its
# slowest tests, to keep an eye on the suite's time): beside another
# worker its ranks would outnumber the cores; then what depends on the CPU's floating-point
# kernels, once under each instruction set the CPU has (tests/cpu_capabilities.py), so a
# rounding difference shows here before it shows on another machine. Exit status 5 is
# "no test selected" (ARGS).
PASSED_OR_NONE = rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ] || exit $$rc
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -n 2 --durations=10 -m "not alone and not numerics" $(ARGS); $(PASSED_OR_NONE); \
	$(VENV)/bin/python -m pytest -q --durations=5 -m alone $(ARGS); $(PASSED_OR_NONE); \
	for cap in $$($(VENV)/bin/python tests/cpu_capabilities.py); do \
	  echo "numerics under ATEN_CPU_CAPABILITY=$$cap"; \
	  ATEN_CPU_CAPABILITY=$$cap $(VENV)/bin/python -m pytest -q -m numerics $(ARGS); $(PASSED_OR_NONE); \
	done

# The in-process tier, for working: no test that starts a process (marker `processes`; one that
# does fails here, tests/conftest.py), nothing that times against a prediction, hypothesis at
# 10 examples. `make test` stays the whole suite.
test-fast: $(STAMP)
	DFLOP_TEST_TIER=fast DFLOP_HYPOTHESIS_EXAMPLES=10 $(VENV)/bin/python -m pytest -q -n 2 \
	  -m "not processes and not alone and not numerics" $(ARGS)

# Every benchmark, then benchmarks/REPORT.md and benchmarks/results/*.json (ARGS=--quick: a dry run).
# One thread per process, as the torch backend's CPU ranks and the shipped CPU profile run.
bench: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python benchmarks/report.py $(ARGS)

# What only a GPU can show (benchmarks/gpu_check.py), in at most 8 minutes, into
# benchmarks/results/gpu-<device>-<date>/ and REPORT.md. It runs under GPU_PYTHON, the Python that
# holds the GPU machine's CUDA torch (dflop and its dependencies importable there). DRY=1: the same
# steps on this machine's CPU with tiny shapes, into GPU_CHECK_OUT (`make test` runs it).
GPU_PYTHON    ?= python3
GPU_CHECK_OUT ?= $(shell mktemp -d)
ifeq ($(DRY),1)
gpu-check: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python benchmarks/gpu_check.py --dry --out $(GPU_CHECK_OUT) $(ARGS)
else
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py $(ARGS)
endif

# Execute every notebook (or NOTEBOOKS="notebooks/x.ipynb ...") and store it with its outputs.
notebooks: $(STAMP)
	$(VENV)/bin/python notebooks/execute.py $(NOTEBOOKS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
