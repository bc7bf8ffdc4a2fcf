# Everything starts from a fresh machine: `make demo` and `make test` build the
# virtualenv first. torch is installed before anything else, so that no other package
# pulls a torch of its own, and by default its CPU build: torch==VERSION+cpu where the
# package index has it (a wheel on disk, a mirror), else from PyTorch's CPU index (on
# plain PyPI, Linux's torch is the multi-GB CUDA build). TORCH_SPEC, where set, is
# installed instead, e.g. for a GPU machine:
#   make test TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_SPEC ?=
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
DEMO_DIR := demo-data# jobs/configs/digits.yaml reads it there
BIN := $(VENV)/bin
# raypipe's own local Ray listens on 127.0.0.1 with nothing set; the tests' `ray start`
# heads and the benchmarks that call ray.init themselves need Ray's switch for that
test bench: export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv bench bench-peers clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py raypipe/preprocess/_jpegregion.c raypipe/preprocess/_draws.c
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
ifeq ($(strip $(TORCH_SPEC)),)
	$(BIN)/pip install --quiet "torch==$(TORCH_VERSION)+cpu" 2> $(VENV)/torch-cpu.log || { \
	    echo "make: torch $(TORCH_VERSION)+cpu not installed from the package index (why:" \
	        "pip's output in $(VENV)/torch-cpu.log); trying $(TORCH_CPU_INDEX)"; \
	    $(BIN)/pip install --quiet "torch==$(TORCH_VERSION)" --index-url $(TORCH_CPU_INDEX); }
else
	$(BIN)/pip install --quiet $(TORCH_SPEC)
endif
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

$(DEMO_DIR)/.done: | $(STAMP)
	$(BIN)/raypipe demo-data $(DEMO_DIR)
	touch $@

demo: $(STAMP) $(DEMO_DIR)/.done
	$(BIN)/raypipe run jobs/configs/digits.yaml

lint: $(STAMP)
	$(BIN)/ruff check raypipe jobs tests benchmarks
	$(BIN)/ruff format --check raypipe jobs tests benchmarks

test: SHELL := /bin/bash
test: .SHELLFLAGS := -o pipefail -c
test: lint  # on a failure, Ray's fatal log lines, then pytest's verdict again, end the output
	rm -f .pytest.current; touch .pytest.start; RAYPIPE_TEST_CURRENT=.pytest.current $(BIN)/python -m pytest -q -rsfE --durations=15 2>&1 \
	    | tee .pytest.log || { status=$$?; bash .ci/ray-logs .pytest.log; exit $$status; }

bench: $(STAMP)
	$(BIN)/python benchmarks/ingest.py --size small

# raypipe beside LitData and MosaicML Streaming (benchmarks/peers.py), which it installs
bench-peers: export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
bench-peers: $(STAMP)
	$(BIN)/pip install --quiet -r benchmarks/peers-requirements.txt
	$(BIN)/pip install --quiet --no-deps -r benchmarks/peers-nodeps.txt
	$(BIN)/python benchmarks/peers.py --images 4096 --epochs 4 --rounds 5

clean:
	rm -rf $(VENV) $(DEMO_DIR) build .pytest_cache .ruff_cache .pytest.log .pytest.current .pytest.start raypipe/preprocess/*.so
