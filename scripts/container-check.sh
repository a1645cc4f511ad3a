#!/usr/bin/env bash
# The container check in one command (docs/deploy.md, "Containers"): builds the CPU image from
# deploy/docker/Dockerfile.cpu, runs target, a draft replica and the orchestrator from it with the commands the Helm
# chart renders, and plays the chart's cpu-demo manifests with `podman kube play`; prints what held and exits 1 if
# anything did not. Not run by CI (it takes minutes and root).
#
#   bash scripts/container-check.sh [--base-image IMAGE] [--torch-wheels DIR]
#
# Needs root and Debian's podman with runc: where podman, runc or debootstrap is missing, it installs them with apt-get
# first (podman runc debootstrap uidmap). Without --base-image the base is made here by scripts/make-base-image.sh
# (debootstrap); without --torch-wheels, torch's CPU wheel comes from the directory pip's configuration names
# (global.find-links) where it holds one, else from PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

missing=()
for tool in podman runc debootstrap; do
    command -v "${tool}" >/dev/null || missing+=("${tool}")
done
if ((${#missing[@]})); then
    echo "container-check: installing podman runc debootstrap uidmap (missing: ${missing[*]})"
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends podman runc debootstrap uidmap >/dev/null
fi

python=python3
[[ -x .venv/bin/python ]] && python=.venv/bin/python
python="${PYTHON:-${python}}"
helm="$(PYTHON="${python}" bash scripts/get-helm.sh)"

wheels=()
while read -r link; do
    if [[ -d "${link}" ]] && compgen -G "${link}/torch-2.13.0+cpu-*.whl" >/dev/null; then
        wheels=(--torch-wheels "${link}")
        break
    fi
done < <("${python}" -m pip config get global.find-links 2>/dev/null | tr ' ' '\n')

exec "${python}" scripts/container_check.py --helm "${helm}" ${wheels[@]+"${wheels[@]}"} "$@"
