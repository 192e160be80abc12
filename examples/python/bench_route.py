"""Router.route from Python against the same Rust calls: the bindings' overhead.

    maturin develop --release -m crates/kvkit-py/Cargo.toml
    python examples/python/bench_route.py [workers]

A router of 64 workers (block 16), each holding 8 of 32 pooled 64-block prefixes plus tails of
its own; a query is a pooled prefix plus a fresh tail. Each iteration routes one query and
finishes it. The Rust figure is kvkit._bench_route: the same route_tokens + finish calls on a
copy of the same router, over the same prompts, timed inside Rust. Prompts of 2,048 tokens
(128 blocks, the criterion bench's size) as a list of ints and as array("I") (or bytes: no
per-token conversion), and of 128 tokens (8 blocks: the per-call cost). With a list, reading
the Python ints dominates: CPython's own array("I", tokens) of the same list is printed too.
"""

import array
import random
import sys
import time

import kvkit

BLOCK = 16


def build(workers, seed=7):
    rng = random.Random(seed)
    hasher = kvkit.BlockHasher(BLOCK)
    prefixes = [[rng.randrange(100_000) for _ in range(64 * BLOCK)] for _ in range(32)]
    router = kvkit.Router(block_size=BLOCK)
    for w in range(workers):
        name = f"10.0.{w // 256}.{w % 256}:8000"
        router.add_worker(name)
        for e, p in enumerate(rng.sample(prefixes, 8)):
            tail = [rng.randrange(100_000) for _ in range(32 * BLOCK)]
            router.apply_event(name, e, "stored", hasher.hash(p + tail))
    return router, prefixes, rng


def queries(prefixes, rng, n, tokens):
    out = []
    for _ in range(n):
        p = rng.choice(prefixes)[: min(tokens, 64 * BLOCK)]
        tail = [rng.randrange(100_000) for _ in range(max(0, tokens - len(p)))]
        out.append(p + tail)
    return out


def per_call_py(router, prompts, n):
    route, finish = router.route, router.finish
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter_ns()
        for i in range(n):
            route(i, prompts[i % len(prompts)])
            finish(i)
        best = min(best, (time.perf_counter_ns() - t) / n)
    return best


def per_call_rust(router, prompts, n):
    return min(kvkit._bench_route(router, prompts, n) for _ in range(5))


def main():
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    router, prefixes, rng = build(workers)
    print(f"{workers} workers, block {BLOCK}; best of 5 runs; route + finish per iteration")
    print(f"{'prompt':>22}  {'Python':>9}  {'Rust':>9}  {'overhead':>9}")
    for tokens, n, kind in ((2048, 20_000, "list"), (2048, 50_000, "array"), (128, 100_000, "list")):
        prompts = queries(prefixes, rng, 256, tokens)
        given = [array.array("I", p) for p in prompts] if kind == "array" else prompts
        py = per_call_py(router, given, n)
        rs = per_call_rust(router, prompts, n)
        label = f"{tokens} tokens, {kind}"
        print(f"{label:>22}  {py / 1000:>6.2f} µs  {rs / 1000:>6.2f} µs  {(py - rs) / 1000:>6.2f} µs")
    lst = queries(prefixes, rng, 1, 2048)[0]
    t = time.perf_counter_ns()
    for _ in range(10_000):
        array.array("I", lst)
    print(f"(CPython's array('I', list) of 2048 ints alone: {(time.perf_counter_ns() - t) / 10_000 / 1000:.2f} µs)")


if __name__ == "__main__":
    main()
