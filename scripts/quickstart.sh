#!/usr/bin/env bash
# Sets up, serves a target/draft pair with `tandem serve` (three processes on loopback), streams one
# completion with speculation and one without, prints the acceptance statistics, and stops the stack.
#
# Until the trained demo pair lands (issue 5), the pair is a tiny RANDOM Llama target with a random
# EAGLE3 head: the text is gibberish, but every component runs for real and greedy outputs match.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source .venv/bin/activate

pair="$(mktemp -d)/pair"
python -m tests.helpers.checkpoints "$pair"

log="$(mktemp)"
tandem serve --target "$pair/target" --draft "$pair/eagle3" --port 50051 >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
until grep -q "tandem ready" "$log"; do
    if ! kill -0 $server 2>/dev/null; then cat "$log"; exit 1; fi
    sleep 0.5
done
grep "tandem ready" "$log"

echo "--- speculative ---"
tandem generate "def fibonacci(n):" --max-new-tokens 48 --ignore-eos
echo "--- target only ---"
tandem generate "def fibonacci(n):" --max-new-tokens 48 --ignore-eos --no-speculation
