#!/usr/bin/env bash
# Live against simulated, the default synthetic pool (500 requests, --speedup 10, or SPEEDUP):
#   1. kvload -> one kvmock, against kvsim --des-instances 1;
#   2. kvload -> kvrouter -> 4 kvmock, against kvsim --des-instances 4.
# Prints request hit rate, block reuse and TTFT/ITL/E2E p50 for each, and the TTFT ratio.
# With TRACE=FILE (a Mooncake trace, block 512), only the second, on the trace's first REQUESTS.
# Usage: [SPEEDUP=X] [TRACE=FILE] bash benches/live/loop.sh [REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/../.."
n="${1:-500}"
speedup="${SPEEDUP:-10}"
trace="${TRACE:-}"
# The workload flags kvsim and kvload share, and the engines' and router's block size.
work_flags=(--des-num-requests "$n")
bs=16
if [ -n "$trace" ]; then
    work_flags+=(--trace "$trace")
    bs=512
fi
cargo build --release -q -p kvmock -p kvrouter -p kvsim-cli
. benches/live/common.sh
row() {
    python3 - "$1" "$2" <<'PY'
import json, sys
v = json.load(open(sys.argv[1]))
p50 = lambda k: v[k]["p50"]
print(f"| {sys.argv[2]} | {100 * v['request_hit_rate']:.1f}% | {100 * v['block_reuse']:.1f}% | "
      f"{p50('ttft_ms'):.1f} ms | {p50('itl_ms'):.1f} ms | {p50('e2e_ms'):,.0f} ms |")
PY
}
engine() {
    local i="$1" port=$((31300 + $1)) ev=$((15300 + 2 * $1))
    "$bin/kvmock" --host 127.0.0.1 --port "$port" --speedup "$speedup" --block-size "$bs" --enable-kv-events \
        --kv-events-config "{\"publisher\":\"zmq\",\"endpoint\":\"tcp://127.0.0.1:$ev\",\"replay_endpoint\":\"tcp://127.0.0.1:$((ev + 1))\"}" \
        >/dev/null 2>&1 & pids+=($!); disown
    wait_http "$port"
}
load() { "$bin/kvload" --endpoint "$1" --speedup "$speedup" "${work_flags[@]}" --vocab-size 128000 --format json --quiet; }

echo "| run | request hit rate | block reuse | TTFT p50 | ITL p50 | E2E p50 |"
echo "|---|---:|---:|---:|---:|---:|"
if [ -z "$trace" ]; then
    "$bin/kvsim" --des-instances 1 "${work_flags[@]}" --format json >"$work/sim1.json"
    row "$work/sim1.json" "kvsim --des-instances 1"
    engine 0
    load http://127.0.0.1:31300 >"$work/live1.json"
    row "$work/live1.json" "kvload -> kvmock"
    cleanup
fi

"$bin/kvsim" --des-instances 4 "${work_flags[@]}" --format json >"$work/sim4.json"
row "$work/sim4.json" "kvsim --des-instances 4"
workers=()
for i in 0 1 2 3; do
    engine "$i"
    workers+=(--worker "http://127.0.0.1:$((31300 + i)),events=tcp://127.0.0.1:$((15300 + 2 * i)),replay=tcp://127.0.0.1:$((15301 + 2 * i))")
done
"$bin/kvrouter" --host 127.0.0.1 --port 18300 --block-size "$bs" "${workers[@]}" >/dev/null 2>&1 & pids+=($!); disown
wait_http 18300
sleep 0.5
load http://127.0.0.1:18300 >"$work/live4.json"
row "$work/live4.json" "kvload -> kvrouter -> 4 x kvmock"
per=()
for i in 0 1 2 3; do
    per+=("$(curl -s "localhost:$((31300 + i))/metrics" | awk '$1 ~ /^vllm:request_success_total/ { print $2 }' | cut -d. -f1)")
done
echo "requests per engine, live: ${per[*]}; simulated: $(python3 -c "import json; print(' '.join(str(e['requests']) for e in json.load(open('$work/sim4.json'))['per_instance']))" 2>/dev/null || echo '?')"
python3 - "$work" <<'PY'
import json, sys
d = sys.argv[1]
import os
t = lambda f: json.load(open(f"{d}/{f}.json"))["ttft_ms"]["p50"]
one = f"one engine {t('live1') / t('sim1'):.3f}, " if os.path.exists(f"{d}/live1.json") else ""
print(f"TTFT p50 live / simulated: {one}through kvrouter {t('live4') / t('sim4'):.3f}")
PY
