#!/usr/bin/env bash
# The demo in one command: sets up what is missing (.venv with the run-only install, scripts/setup.sh --run-only),
# then serves the bundled demo pair with `tandem serve` (target, draft and orchestrator as three processes on
# loopback), streams one completion, and measures held-out prompts with speculation, without it, and with
# transformers' greedy generate on the same model, interleaved (bench/quickstart.py). About a minute on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ! -x .venv/bin/tandem ]]; then
    echo "scripts/quickstart.sh: no .venv/bin/tandem yet; setting up (scripts/setup.sh --run-only)"
    bash scripts/setup.sh --run-only
fi
exec .venv/bin/python -m bench.quickstart "$@"
