# Shared by the live scripts (sourced): the release binaries, a scratch directory, the
# processes a script starts (killed on exit) and a bounded wait for a /health answer.
bin=target/release
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; pids=(); }
trap 'cleanup; rm -rf "$work"' EXIT
wait_http() { for _ in $(seq 200); do curl -sf "localhost:$1/health" >/dev/null && return; sleep 0.05; done; echo "port $1 never answered" >&2; exit 1; }
