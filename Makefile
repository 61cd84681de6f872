# Quick start: `make run` (the main job), `make test` (the test suite). Both create .venv if needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
# The CPU build of torch; a bare `torch` requirement would pull several GB of CUDA wheels.
TORCH_SPEC := torch==2.13.0

.PHONY: run test lint protos check-protos lint-protos venv clean vllm-env vllm-test

$(BIN)/pipelinerl: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,inference,trainer,reward,coordinator,launcher,deepspeed]"
	touch $@

venv: $(BIN)/pipelinerl

# The main job: one asynchronous RL run on the built-in task (see README, Quick start).
run: venv
	$(BIN)/pipelinerl run --target-reward 0.8

# One OpenMP thread per process: tests start several torch processes at once on small machines,
# and oversubscribed threads slow them down many times over.
test: venv
	OMP_NUM_THREADS=1 $(BIN)/pytest -m "not vllm"

# vLLM pins its own torch, so the vLLM inference server has a virtualenv of its own (.venv-vllm).
vllm-env:
	scripts/vllm_env.sh

# The built-in engine's reference outputs come from .venv, hence `venv` too.
vllm-test: venv vllm-env
	OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest tests/vllm -m vllm

protos: venv
	$(BIN)/python scripts/gen_protos.py

# Regenerating must not change the committed stubs.
check-protos: protos
	git diff --exit-code -- services
	test -z "$$(git status --porcelain --untracked-files=all -- services | grep '_pb2')"

$(BUF):
	npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION)

lint-protos: $(BUF)
	cd protos && ../$(BUF) lint
	$(BUF) breaking protos --against '.git#branch=main,subdir=protos'

lint: venv lint-protos check-protos
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .venv-vllm .tools .pytest_cache .ruff_cache
