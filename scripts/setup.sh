#!/usr/bin/env bash
# Creates .venv (if missing) and installs Tandem into it: with its dev tools and every extra the tests use
# (`tandem[dev]`), or with --run-only what running needs and nothing else.
#
#   bash scripts/setup.sh [--run-only]
#
# torch is installed first, pinned: a looser requirement would pull the CUDA build and several GB of NVIDIA
# packages. Where pip's own configuration has no CPU wheel of it, TANDEM_TORCH_INDEX names the index to take it
# from, e.g. PyTorch's CPU index: TANDEM_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

target='.[dev]'
case "${1-}" in
    "") ;;
    --run-only) target='.' ;;
    *)
        echo "scripts/setup.sh: unknown argument '$1' (usage: bash scripts/setup.sh [--run-only])" >&2
        exit 2
        ;;
esac

if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
torch_index=()
if [[ -n "${TANDEM_TORCH_INDEX-}" ]]; then
    torch_index=(--index-url "${TANDEM_TORCH_INDEX}")
fi
.venv/bin/pip install --quiet --progress-bar off ${torch_index[@]+"${torch_index[@]}"} torch==2.13.0
.venv/bin/pip install --quiet --progress-bar off -e "${target}"
echo "setup done: $(.venv/bin/python -c 'import torch, grpc; print("torch", torch.__version__, "grpcio", grpc.__version__)')"
