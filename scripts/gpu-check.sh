#!/usr/bin/env bash
# The GPU check in one command (docs/gpu.md). On this machine, before a GPU slot:
#   bash scripts/gpu-check.sh --pack [DIR]          wheels the GPU image lacks into DIR/wheels (default .gpu-pack),
#                                                   demo weights parked in DIR/parked; prints the travelling size
#   bash scripts/gpu-check.sh --pack [DIR] --flashinfer   the second run's pack: DIR/wheels and DIR/flashinfer
#   bash scripts/gpu-check.sh --unpark [DIR]        the demo weights back, after the slot
#   bash scripts/gpu-check.sh --dry-run             what a CPU can check of all this (CI runs it)
# On the offline GPU machine, with DIR/wheels (and DIR/flashinfer) carried beside the tree:
#   bash scripts/gpu-check.sh [--out DIR] [--layers N]   results in $OUT, or DIR, or bench/results/gpu/latest
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case "${1:-}" in
    --pack | --unpark | --dry-run)
        command="${1#--}"
        shift
        python=python3
        [[ -x .venv/bin/python ]] && python=.venv/bin/python
        exec "$python" scripts/gpu_check.py "$command" "$@"
        ;;
esac
# The image's python3 holds torch 2.11; the wheels go to a directory of their own on PYTHONPATH, ahead of the
# image's packages, and Tandem runs from the source tree (no `pip install`, so no torch pin to satisfy).
site="${TANDEM_GPU_SITE:-/tmp/tandem-site}"
shopt -s nullglob
wheels=(.gpu-pack/wheels/*.whl .gpu-pack/flashinfer/*.whl)
if ((${#wheels[@]})); then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "${wheels[@]}"
fi
# A wheel too large to travel as a zip (FlashInfer's) comes as an xz tar of its files: unpacked where pip would.
for archive in .gpu-pack/flashinfer/*.tar.xz; do
    timeout 120 python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
        "$archive" "$site"
done
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out="${OUT:-bench/results/gpu/latest}"
exec timeout 470 python3 scripts/gpu_check.py run --out "$out" "$@"
