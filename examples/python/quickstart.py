"""kvkit from Python: hash, route with vLLM-shaped KV events, simulate.

    pip install maturin msgpack && maturin develop --release -m crates/kvkit-py/Cargo.toml
    python examples/python/quickstart.py

(msgpack only builds the example's vLLM payloads; a real router receives them from vLLM's
ZMQ publisher.)
"""

import msgpack

import kvkit

BLOCK = 16

# 1. Hashing: the same block hashes as the Rust router, the simulator and kvblock.
hasher = kvkit.BlockHasher(BLOCK)
system_prompt = list(range(1000, 1000 + 64))  # 4 blocks
print("block hashes of the system prompt:", [hex(h) for h in hasher.hash(system_prompt)])

# 2. Routing. Two engines; engine "10.0.0.8:8000" reports (as vLLM would, over ZMQ) that it
# cached the system prompt.
router = kvkit.Router(block_size=BLOCK, policy="kv", overlap_weight=1.0)
router.add_worker("10.0.0.7:8000")
router.add_worker("10.0.0.8:8000")
batch = [
    1700000000.0,  # timestamp
    [
        {
            "type": "BlockStored",
            "block_hashes": [101, 102, 103, 104],  # the engine's own hashes: only mapped
            "parent_block_hash": None,
            "token_ids": system_prompt,
            "block_size": BLOCK,
            "medium": "GPU",
        }
    ],
    0,  # data-parallel rank
]
summary = router.apply_vllm_batch("10.0.0.8:8000", msgpack.packb(batch), seq=0)
print("applied:", summary["blocks_stored"], "blocks")

request = system_prompt + [7, 8, 9] * 20
decision = router.route(1, request, explain=True)
print(f"request 1 -> {decision.worker}: {decision.cache_hits} of {decision.request_blocks} blocks cached, cost {decision.cost}")
for c in decision.candidates:
    print(f"   {c.worker}: hits {c.cache_hits}, active {c.active_blocks}, cost {c.cost}")
router.finish(1)
print("cache view:", {w: router.cache_view(w) for w in router.workers()})

# A restarted router starts warm from a snapshot.
snapshot = router.snapshot()
restarted = kvkit.Router(block_size=BLOCK)
restarted.restore(snapshot)
assert restarted.route(2, request).worker == decision.worker

# 3. Simulating: kvsim's report as a dict, every kvsim flag a keyword.
report = kvkit.simulate(des_instances=4, des_num_requests=200, des_block_size=512, des_prefix_len=2048, des_num_prefixes=8)
print(f"simulated: hit rate {report['request_hit_rate']:.1%}, TTFT p50 {report['ttft_ms']['p50']:.1f} ms")
rows = kvkit.sweep({"des_overlap_weight": [0, 1, 4]}, des_num_requests=200)
for row in rows:
    print(f"   weight {row['value']}: hit rate {row['request_hit_rate']:.1%}, TTFT p99 {row['ttft_p99_ms']:.0f} ms")
try:
    kvkit.simulate(des_instances=0)
except kvkit.SimError as e:
    print("SimError:", e)
