#!/usr/bin/env bash
# Serves the bundled demo pair with `tandem serve` (target, draft and orchestrator as three processes on
# loopback), streams the same greedy completion with speculation and without, prints the tokens per second of
# each and the speedup, and stops the stack. Needs .venv from `bash scripts/setup.sh --run-only` (or without
# --run-only: the dev install has all of it too).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [[ ! -x .venv/bin/tandem ]]; then
    echo "scripts/quickstart.sh: no .venv/bin/tandem here; install first: bash scripts/setup.sh --run-only" >&2
    exit 2
fi
# shellcheck disable=SC1091
source .venv/bin/activate

log="$(mktemp)"
completion="$(mktemp)"
tandem serve --port 0 --admin-port 0 >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true; rm -f "$log" "$completion"' EXIT
until grep -q "tandem ready" "$log"; do
    if ! kill -0 $server 2>/dev/null; then
        cat "$log"
        exit 1
    fi
    sleep 0.5
done
grep "tandem ready" "$log"
address="$(sed -n 's/.*tandem ready: Generate on \([^ ]*\) .*/\1/p' "$log" | head -n 1)"

# One short request in each mode first: the first forward passes of a fresh process are slower than the rest.
for mode in "" --no-speculation; do
    tandem generate "def main():" --address "$address" --max-new-tokens 8 ${mode:+"$mode"} >/dev/null
done

prompt=$'import json\n\n\ndef load_config(path):\n    """Read a JSON configuration file and return it as a dict."""\n'
# Streams the completion (and its statistics line) to the terminal and into $completion.
complete() {
    tandem generate "$prompt" --address "$address" --max-new-tokens 96 "$@" | tee "$completion"
}
rate() {
    sed -n 's/.*tokens_per_second=\([0-9.]*\)\].*/\1/p' "$completion"
}
echo "--- speculative (EAGLE3 head, up to 5 draft tokens a round) ---"
complete
speculative="$(rate)"
echo "--- target only (--no-speculation) ---"
complete --no-speculation
target_only="$(rate)"
echo "---"
if [[ -z "$speculative" || -z "$target_only" ]]; then
    echo "scripts/quickstart.sh: a completion printed no tokens_per_second (see its output above)" >&2
    exit 1
fi
awk -v s="$speculative" -v t="$target_only" \
    'BEGIN { printf "speculative %.1f tok/s, target only %.1f tok/s: %.2fx\n", s, t, s / t }'
