#!/usr/bin/env bash
# Creates .venv (if missing) and installs Tandem with its dev tools. torch is installed first, pinned:
# a looser requirement would pull the CUDA build and several GB of NVIDIA packages.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
fi
.venv/bin/pip install --quiet --progress-bar off torch==2.13.0
.venv/bin/pip install --quiet --progress-bar off -e '.[dev]'
echo "setup done: $(.venv/bin/python -c 'import torch, grpc; print("torch", torch.__version__, "grpcio", grpc.__version__)')"
