# sat — the command index. `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers: most tests wait on subprocesses (a CLI run, an engine, a server), so two
# workers fill two cores; tests that share a server stay on one worker (xdist_group)
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup
# SGLang's CPU environment (`make sglang-cpu`; docs/sglang.md): its own interpreter, never imported
# by sat. SGLang's CPU kernel has no PyPI build: `make sglang-cpu` installs SGLANG_KERNEL_WHEEL
# if set, else the project's wheel in ../shared if present, else the one `make sglang-kernel`
# built from source (scripts/build_sglang_kernel.sh) into SGLANG_KERNEL_DIR/dist.
SGLANG_VENV ?= .venv-sglang
SGLANG_KERNEL_WHEEL ?=
SGLANG_KERNEL_SHARED := ../shared/sglang-cpu/sglang_kernel_cpu-0.4.6.post1-cp311-cp311-linux_x86_64.whl
SGLANG_KERNEL_DIR ?= build/sglang-kernel
SGLANG_STAMP := $(SGLANG_VENV)/.installed
# torch, installed first and on its own (README "Install"). TORCH_SPEC is the requirement;
# TORCH_INDEX_URL, when set, the only index it is taken from, e.g. a CPU-only machine:
#   make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# constraints-cpu.txt keeps the later install from replacing it (used with the default spec only).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
TORCH_ARGS = $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
CONSTRAINTS = $(if $(filter torch==2.13.0,$(TORCH_SPEC)),-c constraints-cpu.txt)

.DEFAULT_GOAL := help

help: ## list the targets
	@grep -E '^[a-zA-Z_-]+:.*?## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*?## "}; {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(CONSTRAINTS) $(TORCH_ARGS) '$(TORCH_SPEC)'
	$(BIN)/python -m pip install -q $(CONSTRAINTS) -e '.[dev,megatron,cluster]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install sat with dev tools, megatron-core and the cluster extras (idempotent)

$(SGLANG_STAMP): requirements-sglang-cpu.txt
	@wheel='$(SGLANG_KERNEL_WHEEL)'; from='SGLANG_KERNEL_WHEEL'; \
	if [ -z "$$wheel" ] && [ -f '$(SGLANG_KERNEL_SHARED)' ]; then \
	  wheel='$(SGLANG_KERNEL_SHARED)'; from='../shared, built for this project'; fi; \
	if [ -z "$$wheel" ]; then \
	  wheel="$$(ls $(SGLANG_KERNEL_DIR)/dist/sglang_kernel_cpu-*.whl 2>/dev/null | head -n 1)"; \
	  from='built from source by make sglang-kernel'; fi; \
	if [ -z "$$wheel" ]; then \
	  echo "make sglang-cpu: no SGLang CPU kernel wheel: SGLANG_KERNEL_WHEEL is unset, $(SGLANG_KERNEL_SHARED) is absent and $(SGLANG_KERNEL_DIR)/dist has none. Run \`make sglang-kernel\` first (builds it from source; docs/sglang.md)" >&2; exit 2; fi; \
	if [ ! -f "$$wheel" ]; then echo "make sglang-cpu: SGLANG_KERNEL_WHEEL=$$wheel not found" >&2; exit 2; fi; \
	echo "make sglang-cpu: SGLang CPU kernel wheel $$wheel ($$from)"; \
	set -ex; \
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV); \
	$(SGLANG_VENV)/bin/python -m pip install -q --upgrade pip; \
	$(SGLANG_VENV)/bin/python -m pip install -q -r requirements-sglang-cpu.txt; \
	$(SGLANG_VENV)/bin/python -m pip install -q --no-deps sglang==0.5.23 torchvision==0.28.0 sglang-router==0.3.2 "$$wheel"; \
	touch $(SGLANG_STAMP)

sglang-cpu: $(SGLANG_STAMP) ## build .venv-sglang (SGLANG_VENV): a real SGLang 0.5.23 server on this CPU (AVX-512); `make test` then runs its tier

sglang-kernel: ## build SGLang's CPU kernel wheel from source into build/sglang-kernel/dist (SGLANG_SRC=<checkout>, else download; about 17 min on 2 cores)
	SGLANG_KERNEL_OUT='$(SGLANG_KERNEL_DIR)' scripts/build_sglang_kernel.sh

run: $(STAMP) ## install, then `sat train` on the embedded default (tiny Qwen3-MoE, toy task, CPU)
	$(BIN)/sat train

test: $(STAMP) ## install, then the default test suite (no slow tests; a few minutes on 2 cores)
	$(BIN)/python -m pytest -m "not slow and not gpu" $(XDIST) $(PYTEST_ARGS)

test-full: $(STAMP) ## all CPU tests, slow integration tests included
	$(BIN)/python -m pytest -m "not gpu" $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP) ## run the benchmarks in bench/ (results are recorded in bench/README.md)
	$(BIN)/python bench/cli_startup.py
	$(BIN)/python bench/loss_overhead.py

gpu-bundle: ## wheels for a bare, air-gapped GPU node into .gpu_deps/wheels (GPU_PYVER, default 3.12; <= 64 MiB): carry it for scripts/gpu_check.sh
	scripts/gpu_bundle.sh

lint: $(STAMP) ## ruff check and format check
	$(BIN)/ruff check sat_cli tests bench
	$(BIN)/ruff format --check sat_cli tests bench

clean: ## remove the venvs, caches and build outputs (keeps runs/)
	rm -rf $(VENV) $(SGLANG_VENV) build dist *.egg-info .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

.PHONY: help install sglang-cpu sglang-kernel run test test-full bench gpu-bundle lint clean
