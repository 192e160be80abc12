#!/usr/bin/env bash
# The router under faults, as a client sees it: kvload (streamed requests of the default
# synthetic pool, open loop) -> kvrouter -> 3 kvmock engines at --speedup 10, one scenario at a
# time, each on fresh processes. Engine 0 is the one that fails:
#   none      no fault (the baseline)
#   kill      SIGKILLed 2 s into the run, not restarted (its streams move: --migration-limit)
#   flap      SIGKILLed and restarted every 2 s for the whole run
#   5xx       answers 30% of requests with 500 (kvmock --fault-error-rate 0.3)
#   stall     waits 3 s before every answer; the router gives up after 1 s (--upstream-timeout-s)
#   overload  the router takes 24 requests at once (--max-concurrency, 100 ms queue) under 5x
#             the offered load: its 429s (with Retry-After) are by design, counted apart
# Prints a Markdown table: requests, faults, what the router did (retries, moved answers, 429s),
# the requests a client saw fail, and TTFT p50/p99 in wall milliseconds.
# Usage: bash benches/live/chaos.sh [REQUESTS] (default 1200, at 100 requests/s)
set -euo pipefail
cd "$(dirname "$0")/../.."
n="${1:-1200}"
rate=100
cargo build --release -q -p kvmock -p kvrouter
. benches/live/common.sh
metric() { curl -s "localhost:$1/metrics" | awk -v m="$2" '$1 == m || index($1, m "{") == 1 { s += $2 } END { print s + 0 }'; }

engine() { # engine I [FLAGS...]: starts engine I on its ports; prints nothing
    local i="$1"
    shift
    local port=$((31300 + i)) ev=$((15300 + 2 * i)) rp=$((15301 + 2 * i))
    "$bin/kvmock" --host 127.0.0.1 --port "$port" --speedup 10 --enable-kv-events \
        --kv-events-config "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$ev\",\"replay_endpoint\":\"tcp://127.0.0.1:$rp\"}" \
        "$@" >/dev/null 2>&1 &
    echo $! >"$work/engine$i.pid"
    pids+=($!)
    disown
    wait_http "$port"
}

kill_engine() { kill -9 "$(cat "$work/engine$1.pid")" 2>/dev/null || true; }

echo "| scenario | requests | faults injected | retries | answers moved | 429 (by design) | client errors | TTFT p50 | TTFT p99 |"
echo "|---|---:|---|---:|---:|---:|---:|---:|---:|"
for scenario in none kill flap 5xx stall overload; do
    faulty=()
    router_flags=()
    offered=$rate
    case $scenario in
    5xx) faulty=(--fault-error-rate 0.3) ;;
    stall) faulty=(--fault-stall-ms 3000) router_flags=(--upstream-timeout-s 1) ;;
    overload) router_flags=(--max-concurrency 24 --queue-timeout-ms 100) offered=$((rate * 5)) ;;
    esac
    engine 0 ${faulty[@]+"${faulty[@]}"}
    engine 1
    engine 2
    workers=()
    for i in 0 1 2; do
        workers+=(--worker "http://127.0.0.1:$((31300 + i)),events=tcp://127.0.0.1:$((15300 + 2 * i)),replay=tcp://127.0.0.1:$((15301 + 2 * i))")
    done
    "$bin/kvrouter" --host 127.0.0.1 --port 18300 --router-tokenizer-path builtin:bytes \
        "${workers[@]}" ${router_flags[@]+"${router_flags[@]}"} >/dev/null 2>&1 &
    router=$!
    pids+=($router)
    disown
    wait_http 18300
    for _ in $(seq 200); do
        curl -sf localhost:18300/v1/admin/workers | grep -q '"subscribed":false' || break
        sleep 0.05
    done
    "$bin/kvload" --endpoint http://127.0.0.1:18300 --des-num-requests "$n" --request-rate "$offered" \
        --format json --quiet >"$work/out.json" &
    load=$!
    faults="none"
    case $scenario in
    kill)
        sleep 2
        kill_engine 0
        faults="1 SIGKILL mid-run"
        ;;
    flap)
        kills=0
        while kill -0 "$load" 2>/dev/null; do
            sleep 2
            kill -0 "$load" 2>/dev/null || break
            kill_engine 0
            kills=$((kills + 1))
            engine 0
        done
        faults="$kills SIGKILLs and restarts"
        ;;
    5xx) faults="500 on 30% at engine 0" ;;
    stall) faults="3 s stall at engine 0" ;;
    overload) faults="5x the offered load" ;;
    esac
    wait "$load" || true
    retries=$(metric 18300 kvrouter_retries_total)
    moved=$(metric 18300 kvrouter_migrations_total)
    busy=$(metric 18300 kvrouter_rejected_busy_total)
    python3 - "$work/out.json" "$scenario" "$n" "$faults" "$retries" "$moved" "$busy" <<'EOF'
import json, sys
path, scenario, n, faults, retries, moved, busy = sys.argv[1:]
v = json.load(open(path))
visible = sum(e["count"] for e in v.get("errors", []) if e["reason"] != "HTTP 429")
t = v["ttft_ms"]
print(f"| {scenario} | {n} | {faults} | {int(float(retries))} | {int(float(moved))} | {int(float(busy))} | {visible} | {t['p50']:.1f} ms | {t['p99']:.1f} ms |")
EOF
    cleanup
    sleep 0.5
done
