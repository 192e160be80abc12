#!/usr/bin/env bash
# What kvrouter adds to a request: kvload -> kvmock directly, against kvload -> kvrouter ->
# kvmock, at 200 req/s, 2,000 streamed requests of the default synthetic pool, kvmock --speedup 1000 so that the engine's own time is negligible. Runs each path
# RUNS times (default 2), the two in turn, and prints TTFT and E2E p50/p99 in wall milliseconds.
# Usage: bash benches/live/overhead.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/../.."
runs="${1:-2}"
cargo build --release -q -p kvmock -p kvrouter
. benches/live/common.sh

"$bin/kvmock" --host 127.0.0.1 --port 31200 --speedup 1000 --enable-kv-events \
    --kv-events-config '{"publisher":"zmq","endpoint":"tcp://127.0.0.1:15200","replay_endpoint":"tcp://127.0.0.1:15201"}' \
    >/dev/null 2>&1 & pids+=($!); disown
wait_http 31200
"$bin/kvrouter" --host 127.0.0.1 --port 18200 \
    --worker http://127.0.0.1:31200,events=tcp://127.0.0.1:15200,replay=tcp://127.0.0.1:15201 \
    >/dev/null 2>&1 & pids+=($!); disown
wait_http 18200
sleep 0.5

echo "| path | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 |"
echo "|---|---:|---:|---:|---:|"
# The two paths take turns, so that a noisy moment hits both.
for _ in $(seq "$runs"); do
    for path in "kvload -> kvmock:31200" "kvload -> kvrouter -> kvmock:18200"; do
        label=${path%:*} port=${path##*:}
        "$bin/kvload" --endpoint "http://127.0.0.1:$port" --des-num-requests 2000 --request-rate 200 \
            --format json --quiet |
            python3 -c "
import json, sys
v = json.load(sys.stdin)
t, e = v['ttft_ms'], v['e2e_ms']
print(f\"| $label | {t['p50']:.2f} ms | {t['p99']:.2f} ms | {e['p50']:.2f} ms | {e['p99']:.2f} ms |\")"
    done
done
