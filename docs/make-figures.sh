#!/usr/bin/env bash
# Draws the book's figures from the tools' own output, into docs/src/figures/, and writes the
# README's crate table and dependency diagram from `cargo metadata`. Run from anywhere; commit
# what it changes. `--house` does only the last part (cheap: no simulation); `--check` fails
# when the README's table or diagram is not what the manifests say (CI runs that).
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/src/figures
mode=${1:-all}

house() {
    cargo metadata --format-version 1 --no-deps --offline | python3 -c '
import json, re, sys
meta = json.load(sys.stdin)
members = {p["name"]: p for p in meta["packages"]}
order = ["kvblock", "kvcache", "kvroute", "kvroute-vllm", "kvserve", "kvsim", "kvsim-cli",
         "kvmock", "kvrouter", "kvkit", "kvtest"]
order += sorted(set(members) - set(order))

def deps(p):
    """Normal dependencies: (name, the feature that turns it on, or None)."""
    feats = {}
    for f, items in p["features"].items():
        for i in items:
            if i.startswith("dep:"):
                feats.setdefault(i[4:], f)
    out = []
    for d in p["dependencies"]:
        if d["kind"] is None:
            name = d.get("rename") or d["name"]
            out.append((d["name"], feats.get(name) if d["optional"] else None))
    return sorted(set(out), key=lambda x: (x[0] not in members, x[0]))

rows = ["| crate | what it is | depends on | MSRV |", "|---|---|---|---|"]
edges = []
for n in order:
    p = members[n]
    here = "." if n == "kvkit" else "crates/" + n
    link = f"[`{n}`]({here})" if n != "kvkit" else "`kvkit` (root)"
    plain = [d for d, f in deps(p) if f is None]
    gated = {}
    for d, f in deps(p):
        if f is not None:
            gated.setdefault(f, []).append(d)
    text = ", ".join(plain) or "nothing"
    for f, ds in sorted(gated.items()):
        text += f"; feature `{f}`: " + ", ".join(ds)
    if p.get("publish") == []:
        text += " (never published)"
    desc, msrv = p["description"], p["rust_version"] or "-"
    rows.append(f"| {link} | {desc} | {text} | {msrv} |")
    for d, f in deps(p):
        if d in members:
            edges.append((n, d, f))
# The graph shows an edge only where no longer path already leads there (a transitive
# reduction), so that the layers stay readable; the table lists every dependency.
def reaches(a, b, skip):
    seen = set()
    # Only unconditional edges make a path: a feature may be off.
    todo = [y for x, y, f in edges if x == a and (x, y) != skip and f is None]
    while todo:
        n = todo.pop()
        if n == b:
            return True
        if n not in seen:
            seen.add(n)
            todo += [y for x, y, f in edges if x == n and f is None]
    return False
edges = [(a, b, f) for a, b, f in edges if not reaches(a, b, (a, b))]
mermaid = ["```mermaid", "graph BT"]
for a, b, f in edges:
    arrow = f" -.->|{f}| " if f else " --> "
    ida, idb = a.replace("-", "_"), b.replace("-", "_")
    mermaid.append(f"    {ida}[{a}]{arrow}{idb}[{b}]")
mermaid.append("```")
open("docs/src/figures/house.mmd", "w").write("\n".join(mermaid[2:-1]) + "\n")

readme = open("README.md").read()
def put(text, name, body):
    start, end = f"<!-- {name}:begin -->\n", f"<!-- {name}:end -->"
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + body + "\n" + text[b:]
new = put(put(readme, "crates", "\n".join(rows)), "house", "\n".join(mermaid))
if sys.argv[1] == "check":
    if new != readme:
        sys.exit("README.md: the crate table or the diagram is not what the manifests say: run docs/make-figures.sh --house")
else:
    open("README.md", "w").write(new)
' "$1"
}

case "$mode" in
--check) house check; exit 0 ;;
--house) house write; exit 0 ;;
esac

cargo build --release --quiet -p kvsim-cli
kvsim="${CARGO_TARGET_DIR:-target}/release/kvsim"

# The overlap-weight sweep of "Simulating a fleet".
"$kvsim" sweep --param des-overlap-weight=0,0.5,1,2,4,8 --des-instances 8 --des-kv-blocks 4000 \
    --des-num-prefixes 16 --prefix-popularity zipf:1.2 --des-num-requests 2000 \
    --request-rate 40 --plot "$out/sweep-overlap-weight.svg" --quiet >/dev/null
# The capacity search of "Capacity planning".
"$kvsim" capacity --slo-ttft-ms 2000 --slo-itl-ms 50 --attainment 0.99 \
    --des-num-requests 2000 --runs 12 --plot "$out/capacity-rate.svg" --quiet >/dev/null
# The fidelity plots of "Calibrating against real engines" (the real vLLM runs beside the repo).
for run in codellama-34b llama-2-7b; do
    data=../shared/data/vllm-otel/$run
    "$kvsim" calibrate --spans "$data/traces.otel.jsonl" --vllm-log "$data/vllm.log" \
        --fit-phases 0,1 --plot "$out/fidelity-$run-held-out.svg" --quiet >/dev/null
    "$kvsim" calibrate --spans "$data/traces.otel.jsonl" --vllm-log "$data/vllm.log" \
        --plot "$out/fidelity-$run-all.svg" --quiet >/dev/null
done
house write
echo "figures written to $out/ and the README's crate table and diagram updated"
