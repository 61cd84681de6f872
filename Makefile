# Quick start: `make run` (the main job), `make test` (the test suite). Both create .venv if needed.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
PYRIGHT_VERSION := 1.1.414
PYRIGHT := .tools/node_modules/.bin/pyright
# The CPU build of torch; a bare `torch` requirement would pull several GB of CUDA wheels.
TORCH_SPEC := torch==2.13.0

# A strict editable install: a plain .pth names build/__editable__.pipelinerl-*/, a tree of links
# to the files under services/, which IDEs and type checkers follow (an import hook they cannot).
EDITABLE := --config-settings editable_mode=strict
# Every file the link tree must hold; when the list changes, the tree is made again.
MODULES = $(shell find services -name '*.py' -o -name '*.pyi' -o -name py.typed | LC_ALL=C sort)

.PHONY: run test lint typecheck protos check-protos lint-protos venv clean vllm-env vllm-test gpu-wheels k8s-check compose-test clients check-clients clients-test docs prometheus-test

$(BIN)/pipelinerl: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,docs,inference,trainer,reward,coordinator,datasets,launcher,deepspeed,tensorboard,wandb,gymnasium,openenv,agent]" $(EDITABLE)
	touch $@

# Links a module added (or drops one removed) since the last install; quick, no dependencies.
venv: $(BIN)/pipelinerl
	@echo "$(MODULES)" > $(VENV)/modules.new
	@cmp -s $(VENV)/modules.new $(VENV)/modules || { \
		$(BIN)/pip install --quiet --no-deps -e . $(EDITABLE) && mv $(VENV)/modules.new $(VENV)/modules; }

# The main job: one asynchronous RL run on the built-in task (see README, Quick start).
run: venv
	$(BIN)/pipelinerl run --target-reward 0.9

# One OpenMP thread per process: tests start several torch processes at once on small machines,
# and oversubscribed threads slow them down many times over.
test: venv
	OMP_NUM_THREADS=1 $(BIN)/pytest -m "not vllm and not prometheus"

# vLLM pins its own torch, so the vLLM inference server has a virtualenv of its own (.venv-vllm).
vllm-env:
	scripts/vllm_env.sh

# The built-in engine's reference outputs come from .venv, hence `venv` too.
vllm-test: venv vllm-env
	OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest tests/vllm -m vllm

# deploy/compose.yaml on a Docker engine of its own (as root; installs docker.io when missing): build
# the images, a run with an inference container killed mid-run, every attempt trained exactly once,
# then an environment run (guess_number episodes on the environment container) to its end.
compose-test: venv
	scripts/compose_test.sh

# The wheels a GPU machine without network lacks (scripts/gpu-wheels.txt), for CPython 3.12 on
# manylinux x86_64, into .gpu-wheels/ (at most 60 MiB); DeepSpeed is built here as a pure-Python
# wheel. There: pip install --no-index --find-links .gpu-wheels --no-deps .gpu-wheels/*.whl
gpu-wheels: venv
	$(BIN)/python scripts/gpu_wheels.py --dest .gpu-wheels --max-mib 60

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

# The TypeScript client (clients/typescript): its npm dependencies, pinned by its package-lock.json,
# hold the protoc-gen-es plugin that protos/buf.gen.yaml runs.
TS_CLIENT := clients/typescript
$(TS_CLIENT)/node_modules/.package-lock.json: $(TS_CLIENT)/package-lock.json
	cd $(TS_CLIENT) && npm ci --silent --no-audit --no-fund

# Regenerates the TypeScript client's code (clients/typescript/src/gen) from protos/.
clients: $(BUF) $(TS_CLIENT)/node_modules/.package-lock.json
	cd protos && ../$(BUF) generate

# Regenerating must not change the committed client code, and the TypeScript environment server
# (examples/guess-number-env) must still compile against it; part of `lint`.
check-clients: clients
	git diff --exit-code -- $(TS_CLIENT)/src/gen
	test -z "$$(git status --porcelain --untracked-files=all -- $(TS_CLIENT)/src/gen)"
	$(TS_CLIENT)/node_modules/.bin/tsc -p $(TS_CLIENT)/examples/guess-number-env

# The TypeScript client's tests, against the four real services on the tiny model.
clients-test: venv $(TS_CLIENT)/node_modules/.package-lock.json
	cd $(TS_CLIENT) && OMP_NUM_THREADS=1 npm test --silent

$(PYRIGHT):
	npm install --silent --no-audit --no-fund --prefix .tools pyright@$(PYRIGHT_VERSION)

# pyright on services/ and benchmarks/ against .venv (pyrightconfig.json); part of `lint`.
typecheck: venv $(PYRIGHT)
	$(PYRIGHT)

# Every overlay of deploy/k8s rendered and validated against the Kubernetes schemas that
# kubernetes-validate bundles; strict: an unknown field fails, and so does a kind without a schema.
k8s-check: venv
	@for overlay in deploy/k8s/overlays/*; do \
		rendered=$$($(BIN)/kubectl kustomize $$overlay) || exit 1; \
		out=$$(echo "$$rendered" | $(BIN)/kubernetes-validate --strict --quiet - 2>&1); \
		if [ -n "$$out" ]; then echo "$$out"; echo "$$overlay: not valid"; exit 1; fi; \
		echo "$$overlay: valid"; \
	done

# A real Prometheus (Debian's package, installed when missing) scraping a live `pipelinerl run`, and
# promtool on deploy/prometheus.yml and the Grafana dashboard's queries (docs/observability.md).
prometheus-test: venv
	command -v prometheus >/dev/null && command -v promtool >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }
	OMP_NUM_THREADS=1 $(BIN)/pytest -m prometheus tests/e2e/test_prometheus.py

# The documentation site (mkdocs.yml) into site/: docs/, the README as its home page, the API
# reference from docstrings and the contracts' reference from the protos' comments. Strict: a broken
# link or anchor, or a page missing from the nav, fails the build.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: venv lint-protos check-protos check-clients typecheck k8s-check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .venv-vllm .tools build site .pytest_cache .ruff_cache .gpu-wheels $(TS_CLIENT)/node_modules $(TS_CLIENT)/dist
