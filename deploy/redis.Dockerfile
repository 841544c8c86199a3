# Redis from Debian's packages, for machines that reach no container registry (the official
# redis image docker-compose.yml names cannot be pulled there). deploy/compose.offline.yaml
# uses it; `make test-compose` builds it FROM the mmdebstrap base (make image-base).
ARG BASE_IMAGE=kvmesh-base:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/*
# The official image's data folder, where docker-compose.yml mounts the append-only file.
WORKDIR /data
