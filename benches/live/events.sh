#!/usr/bin/env bash
# KV events per second a router applies: a stand-in engine (the kvrouter example event_flood)
# publishes BATCHES batches of 16 new blocks each as fast as it can, and kvrouter applies them
# either straight from the engine's ZMQ socket or through `kvrouter relay` -> JetStream.
# Prints, per path, the batches applied, the time from the first publish to the last apply,
# and batches and blocks per second. Needs nats-server on PATH.
# Usage: bash benches/live/events.sh [BATCHES]
set -euo pipefail
cd "$(dirname "$0")/../.."
batches="${1:-20000}"
cargo build --release -q -p kvrouter --bin kvrouter --example event_flood
. benches/live/common.sh
applied() { curl -s "localhost:18100/metrics" | awk '$1 == "kvrouter_kv_batches_applied_total" { print $2 }'; }

measure() {
    local label="$1"
    local t0 t1 n last=-1 same=0
    t0=$(date +%s.%N)
    "$bin/examples/event_flood" tcp://127.0.0.1:15100 "$batches" 16 >"$work/flood.txt" &
    local flood=$!
    # Until every batch is applied, or nothing moved for 3 s (some were dropped).
    while :; do
        n=$(applied)
        [ "$n" -ge "$batches" ] && break
        if [ "$n" = "$last" ]; then same=$((same + 1)); [ "$same" -ge 60 ] && break; else same=0; last=$n; fi
        sleep 0.05
    done
    t1=$(date +%s.%N)
    wait "$flood" || true
    # The first second is the flood's wait for subscribers; stalled polls are not counted.
    python3 -c "
n, t = $n, $t1 - $t0 - 1.0 - 0.05 * $same
print(f'| {\"$label\"} | {n:,} of {$batches:,} | {t:.2f} s | {n / t:,.0f} | {16 * n / t:,.0f} |')"
}

echo "| path | batches applied | time | batches/s | blocks/s |"
echo "|---|---:|---:|---:|---:|"

"$bin/kvrouter" --host 127.0.0.1 --port 18100 \
    --worker http://127.0.0.1:31999,events=tcp://127.0.0.1:15100 >/dev/null 2>&1 & pids+=($!); disown
wait_http 18100
sleep 0.5
measure "engine ZMQ -> kvrouter"
cleanup

nats-server -js -a 127.0.0.1 -p 14223 -sd "$work/js" >/dev/null 2>&1 & pids+=($!); disown
sleep 0.5
"$bin/kvrouter" --host 127.0.0.1 --port 18100 --kv-event-transport nats --nats-url nats://127.0.0.1:14223 \
    --worker http://127.0.0.1:31999 >/dev/null 2>&1 & pids+=($!); disown
wait_http 18100
"$bin/kvrouter" relay --nats-url nats://127.0.0.1:14223 \
    --worker http://127.0.0.1:31999,events=tcp://127.0.0.1:15100 >/dev/null 2>&1 & pids+=($!); disown
sleep 0.5
measure "engine ZMQ -> relay -> JetStream -> kvrouter"
