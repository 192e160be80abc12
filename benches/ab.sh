#!/usr/bin/env bash
# The `kvsim` command timed against itself at another revision: builds git revision REF (in a
# temporary worktree) and the working tree, runs the two builds in turn ROUNDS times (default 8)
# with the same arguments, checks that they print the same report byte for byte, and prints
# each pair, both medians and the ratios of the working tree's time to REF's (< 1: faster).
# On a shared machine whose speed changes by the hour, only such a ratio, measured in one run,
# compares two versions (PERFORMANCE.md).
#
# Usage: bash benches/ab.sh REF [ROUNDS] [-- KVSIM ARGS...]
#   Without arguments after `--`, the run is PERFORMANCE.md's block-16 simulation: 100,000
#   requests over 16 instances at block 16, 30,000 blocks each.
# Example: bash benches/ab.sh HEAD~3 10
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash benches/ab.sh REF [ROUNDS] [-- KVSIM ARGS...]"
[ $# -ge 1 ] || { echo "ab.sh: REF is required; $usage" >&2; exit 2; }
ref="$1"
shift
rounds=8
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
    rounds="$1"
    shift
fi
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "ab.sh: ROUNDS '$rounds' is not a positive integer; $usage" >&2; exit 2; }
[ $# -eq 0 ] || [ "$1" = "--" ] || { echo "ab.sh: unexpected '$1' (kvsim's arguments go after --); $usage" >&2; exit 2; }
[ $# -eq 0 ] || shift
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--des-num-requests 100000 --des-instances 16 --request-rate 60
    --des-block-size 16 --des-kv-blocks 30000)
rev=$(git rev-parse -q --verify "$ref^{commit}") || { echo "ab.sh: REF '$ref' names no commit" >&2; exit 2; }

work=$(mktemp -d)
trap 'git worktree remove --force "$work/ref" >/dev/null 2>&1; rm -rf "$work"; git worktree prune' EXIT
git worktree add -q --detach "$work/ref" "$rev"
echo "building kvsim at ${rev:0:12} (REF) and from the working tree" >&2
# REF builds into a target directory of its own, kept, so that the next run builds incrementally.
CARGO_TARGET_DIR="$PWD/target/ab-ref" cargo build --release -q -p kvsim-cli \
    --manifest-path "$work/ref/Cargo.toml"
cargo build --release -q -p kvsim-cli
cp target/ab-ref/release/kvsim "$work/ref.bin"
cp target/release/kvsim "$work/this.bin"

python3 - "$work" "$rounds" "${rev:0:12}" "${args[@]}" <<'EOF'
import hashlib, statistics, subprocess, sys, time

work, rounds, rev, args = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
times = {"ref": [], "this": []}
digests = set()
for i in range(rounds):
    for name in ("ref", "this"):
        start = time.perf_counter()
        out = subprocess.run([f"{work}/{name}.bin", *args], stdout=subprocess.PIPE, check=True).stdout
        times[name].append(time.perf_counter() - start)
        digests.add(hashlib.md5(out).hexdigest()[:8])
    print(f"pair {i + 1}: ref {times['ref'][-1]:.3f} s, this {times['this'][-1]:.3f} s "
          f"({times['this'][-1] / times['ref'][-1]:.3f}x)", flush=True)
if len(digests) != 1:
    sys.exit(f"ab.sh: the two builds printed different reports (md5 {', '.join(sorted(digests))})")
for name, label in (("ref", f"ref ({rev})"), ("this", "this (working tree)")):
    t = times[name]
    print(f"{label}: median {statistics.median(t):.3f} s, {min(t):.3f}-{max(t):.3f} s")
ratios = [b / a for a, b in zip(times["ref"], times["this"])]
print(f"this / ref: {min(ratios):.2f}-{max(ratios):.2f}x, median {statistics.median(ratios):.3f}x "
      f"({rounds} pairs, identical reports, md5 {digests.pop()})")
EOF
