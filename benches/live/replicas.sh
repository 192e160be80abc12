#!/usr/bin/env bash
# Live router replicas over NATS: kvload -> R kvrouter replicas (requests round-robin over
# them) -> 4 kvmock engines whose KV events reach the replicas through `kvrouter relay`
# sidecars and a real nats-server with JetStream. Prints, per setup, the hit rate, block reuse,
# requests per engine and their balance (max / mean), with and without --router-replica-sync.
# Needs nats-server on PATH. Usage: bash benches/live/replicas.sh [REQUESTS] [EXTRA KVLOAD FLAGS]
set -euo pipefail
cd "$(dirname "$0")/../.."
n="${1:-500}"
shift || true
cargo build --release -q -p kvmock -p kvrouter
. benches/live/common.sh
metric() { curl -s "localhost:$1/metrics" | awk -v m="$2" '$1 == m || index($1, m "{") == 1 { print $2 }'; }

run() {
    local replicas="$1" sync="$2" label="$3"
    shift 3
    rm -rf "$work/js"
    nats-server -js -a 127.0.0.1 -p 14222 -sd "$work/js" >/dev/null 2>&1 & pids+=($!); disown
    sleep 0.5
    local workers=()
    for i in 0 1 2 3; do
        local port=$((31000 + i)) ev=$((15000 + 2 * i)) rp=$((15001 + 2 * i))
        "$bin/kvmock" --host 127.0.0.1 --port "$port" --speedup 10 --enable-kv-events \
            --kv-events-config "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$ev\",\"replay_endpoint\":\"tcp://127.0.0.1:$rp\"}" \
            >/dev/null 2>&1 & pids+=($!); disown
        wait_http "$port"
        "$bin/kvrouter" relay --nats-url nats://127.0.0.1:14222 \
            --worker "http://127.0.0.1:$port,events=tcp://127.0.0.1:$ev,replay=tcp://127.0.0.1:$rp" \
            >/dev/null 2>&1 & pids+=($!); disown
        workers+=(--worker "http://127.0.0.1:$port")
    done
    local endpoints=""
    for r in $(seq "$replicas"); do
        local port=$((18000 + r)) flags=()
        [ "$sync" = yes ] && flags=(--router-replica-sync --replica-id "$r")
        "$bin/kvrouter" --host 127.0.0.1 --port "$port" --kv-event-transport nats \
            --nats-url nats://127.0.0.1:14222 "${workers[@]}" ${flags[@]+"${flags[@]}"} \
            >/dev/null 2>&1 & pids+=($!); disown
        wait_http "$port"
        endpoints="${endpoints:+$endpoints,}http://127.0.0.1:$port"
    done
    sleep 0.5
    "$bin/kvload" --endpoint "$endpoints" --speedup 10 --des-num-requests "$n" --vocab-size 128000 \
        --format json --quiet "$@" >"$work/out.json"
    local counts=()
    for i in 0 1 2 3; do counts+=("$(metric $((31000 + i)) vllm:request_success_total)"); done
    python3 - "$work/out.json" "$label" "${counts[@]}" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
counts = [float(c) for c in sys.argv[3:]]
mean = sum(counts) / len(counts)
print(f"| {sys.argv[2]} | {100 * v['request_hit_rate']:.1f}% | {100 * v['block_reuse']:.1f}% | "
      f"{' / '.join(str(int(c)) for c in counts)} | {max(counts) / mean:.2f} | "
      f"{v['ttft_ms']['p50']:.1f} ms | {v['ttft_ms']['p99']:.1f} ms |")
PY
    cleanup
    sleep 0.3
}

echo "| replicas | request hit rate | block reuse | requests per engine | balance | TTFT p50 | TTFT p99 |"
echo "|---|---:|---:|---|---:|---:|---:|"
run 1 no "1" "$@"
run 2 no "2, not synced" "$@"
run 2 yes "2, synced" "$@"
run 4 no "4, not synced" "$@"
run 4 yes "4, synced" "$@"
