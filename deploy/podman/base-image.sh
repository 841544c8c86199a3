#!/bin/sh
# Builds the base image deploy/Dockerfile starts FROM where no registry is reachable: a Debian
# root file system made from Debian packages by mmdebstrap and imported into podman.
#   deploy/podman/base-image.sh [IMAGE] [SUITE] [MIRROR]
# It holds Python 3.11 with venv (the version torch's cp311 wheels need), a C compiler (the
# engine builds its CPU kernels at start) and the CA store. Extra CA certificates (a proxy's, a
# wheel mirror's) are taken from deploy/Dockerfile's EXTRA_CA_CERTS build argument, not here.
set -eu
IMAGE=${1:-kvmesh-base:bookworm}
SUITE=${2:-bookworm}
MIRROR=${3:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates,gcc,libc6-dev
ROOTFS=$(mktemp --suffix=.tar)
trap 'rm -f "$ROOTFS"' EXIT
mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
    --aptopt='Acquire::Check-Valid-Until "false"' "$SUITE" "$ROOTFS" "$MIRROR"
podman import --quiet \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/sh"]' \
    --message "mmdebstrap $SUITE minbase + $PACKAGES" \
    "$ROOTFS" "$IMAGE"
echo "kvmesh: base image $IMAGE ($SUITE: $PACKAGES)"
