#!/usr/bin/env bash
# Sets up, serves the bundled demo pair with `tandem serve` (target, draft and orchestrator as three
# processes on loopback), streams one completion with speculation and one without, prints the
# acceptance statistics, and stops the stack.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source .venv/bin/activate

log="$(mktemp)"
tandem serve --port 50051 >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until grep -q "tandem ready" "$log"; do
    if ! kill -0 $server 2>/dev/null; then cat "$log"; exit 1; fi
    sleep 0.5
done
grep "tandem ready" "$log"

prompt=$'import json\n\n\ndef load_config(path):\n    """Read a JSON configuration file and return it as a dict."""\n'
echo "--- speculative (EAGLE3 head, 5 draft steps) ---"
tandem generate "$prompt" --max-new-tokens 96
echo "--- target only ---"
tandem generate "$prompt" --max-new-tokens 96 --no-speculation
