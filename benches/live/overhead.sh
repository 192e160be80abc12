#!/usr/bin/env bash
# What kvrouter adds to a request: kvload -> kvmock directly, against kvload -> kvrouter ->
# kvmock, and the same with OpenTelemetry tracing on (--otlp-traces-endpoint to a local
# collector stand-in that answers 200), and with every feature on, at 200 req/s, 2,000 streamed requests of the default synthetic pool, kvmock --speedup 1000 so that the engine's own time is negligible. Runs each path
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
# A stand-in collector: takes every OTLP/HTTP POST and answers 200.
python3 -c "
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get('Content-Length', 0)))
        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers(); self.wfile.write(b'{}')
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(('127.0.0.1', 14318), H).serve_forever()
" & pids+=($!); disown
"$bin/kvrouter" --host 127.0.0.1 --port 18201 --otlp-traces-endpoint http://127.0.0.1:14318/v1/traces \
    --worker http://127.0.0.1:31200,events=tcp://127.0.0.1:15200,replay=tcp://127.0.0.1:15201 \
    >/dev/null 2>&1 & pids+=($!); disown
wait_http 18201
# Every feature of the router on at once (tracing, admission, retries, migration, sessions,
# rate limit, engine telemetry, the routing model's options), none of them tripping.
"$bin/kvrouter" --host 127.0.0.1 --port 18202 --otlp-traces-endpoint http://127.0.0.1:14318/v1/traces \
    --max-concurrency 4096 --retries 2 --migration-limit 1 --session-affinity soft \
    --rate-limit 1000000 --scrape-metrics-s 1 --cost-model prefill-aware --router-temperature 0.1 \
    --busy-threshold decode=0.9,capacity=1000000,waiting=1000 --predicted-ttl-ms 500 \
    --worker http://127.0.0.1:31200,events=tcp://127.0.0.1:15200,replay=tcp://127.0.0.1:15201 \
    >/dev/null 2>&1 & pids+=($!); disown
wait_http 18202
# The routers follow the engine's KV events before the first request.
for port in 18200 18201 18202; do
    for _ in $(seq 200); do
        curl -sf "localhost:$port/v1/admin/workers" | grep -q '"subscribed":true' && break
        sleep 0.05
    done
done

echo "| path | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 |"
echo "|---|---:|---:|---:|---:|"
# The two paths take turns, so that a noisy moment hits both.
for _ in $(seq "$runs"); do
    for path in "kvload -> kvmock:31200" "kvload -> kvrouter -> kvmock:18200" \
        "kvload -> kvrouter (traced) -> kvmock:18201" \
        "kvload -> kvrouter (every feature on) -> kvmock:18202"; do
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
