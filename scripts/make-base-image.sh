#!/usr/bin/env bash
# Makes a local base image with Python for deploy/docker/Dockerfile.cpu, where no registry image can be pulled:
# Debian's own packages (debootstrap, from the Debian mirror) imported with `podman import`. Prints the image name.
#
#   bash scripts/make-base-image.sh [IMAGE]        (default localhost/tandem-base:bookworm)
#
# The image holds a minimal Debian bookworm with python3 (3.11), its venv module and the CA certificates; the
# Dockerfile makes its own virtual environment on top, as it does on the public python image. Running it again with
# the image in place does nothing. Needs root, debootstrap and podman; DEBIAN_MIRROR picks the mirror.
set -euo pipefail

IMAGE="${1:-localhost/tandem-base:bookworm}"
SUITE="bookworm"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PACKAGES="python3,python3-venv,ca-certificates"

if podman image exists "${IMAGE}"; then
    echo "${IMAGE}"
    exit 0
fi

root="$(mktemp -d)"
trap 'rm -rf "${root}"' EXIT

# debootstrap is I/O- and CPU-heavy for a minute or two: it yields to anything else running on the machine.
nice -n 19 ionice -c3 debootstrap --variant=minbase --include="${PACKAGES}" "${SUITE}" "${root}" "${MIRROR}" >&2
# Package lists and caches are not needed in the image (the Dockerfile installs nothing with apt).
rm -rf "${root}"/var/lib/apt/lists/* "${root}"/var/cache/apt/*.bin "${root}"/var/cache/apt/archives/*.deb
tar --numeric-owner -C "${root}" -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' - "${IMAGE}" >&2
echo "${IMAGE}"
