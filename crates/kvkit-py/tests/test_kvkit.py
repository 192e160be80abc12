"""Tests of the kvkit Python package: run by .ci/run against the built wheel in a fresh
virtualenv (pytest and msgpack installed there)."""

import array
import json
import os
import pathlib
import subprocess
import threading

import msgpack
import pytest

import kvkit

REPO = pathlib.Path(__file__).resolve().parents[3]
FIXTURES = REPO / "crates" / "kvroute-vllm" / "tests" / "fixtures"

# The source document's example run (crates/kvsim-cli/tests/cli.rs, DOC).
DOC = dict(
    request_rate=6,
    arrival_model="poisson",
    des_num_requests=200,
    des_instances=4,
    des_routing="kv",
    des_num_prefixes=8,
    des_prefix_len=2048,
    des_block_size=512,
)


# --- hashing ---------------------------------------------------------------------------------


def test_hashes_equal_kvblock_test_vectors():
    h16 = kvkit.BlockHasher(16)
    assert h16.block_size == 16
    assert h16.local_hashes(list(range(16))) == [0xD47A8F41C833328A]
    assert h16.hash(list(range(16))) == [0xD47A8F41C833328A]
    local = h16.local_hashes(list(range(32)))
    seq = h16.hash(list(range(32)))
    assert local[1] == 0xD43939178ABD00DB
    assert seq[1] == 0xBF15DFFB16447F38
    assert h16.hash(list(range(40))) == seq  # a partial tail is not hashed
    assert h16.local_hashes(list(range(40))) == local
    h64 = kvkit.BlockHasher(64)
    assert h64.local_hashes(list(range(128))) == [0x304D910E689E42BF, 0x2E0CEBB8F3781524]
    assert h64.hash(list(range(128)))[1] == 0x23BD5EF232E90ECB
    assert h16.local_hashes(list(range(16)), salt="my-lora") == [0x6BE4509617B3E757]
    assert h16.hash(range(16)) == h16.hash(tuple(range(16)))  # any sequence of ints
    long = list(range(100, 100 + 200))  # lists from 64 ids on are read through array("I")
    packed = array.array("I", long)
    assert h16.hash(long) == h16.hash(packed) == h16.hash(packed.tobytes()) == h16.hash(tuple(long))


def test_extra_keys_equal_kvblock_vectors():
    h16 = kvkit.BlockHasher(16)
    t = list(range(16))
    image = [("img-A", 0)]
    assert h16.hash(t, extra_keys=[image]) == [0xF9AE8B51A16C49EB]
    assert h16.hash(t, extra_keys=[["tenant-1"]]) == [0x0ED1F3F9C34D631D]
    assert h16.hash(t, salt="my-lora", extra_keys=[image]) == [0x087DCB165654C72A]
    assert h16.hash(t, extra_keys=[[]]) == [0xD47A8F41C833328A]
    s = h16.hash(list(range(32)), extra_keys=[[], image])
    assert s == [0xD47A8F41C833328A, 0xDEDBE3073048E12B]


def test_namespace_changes_the_hash():
    h = kvkit.BlockHasher(16)
    t = list(range(16))
    assert h.hash(t, namespace="a") != h.hash(t)
    assert h.hash(t, namespace="") == h.hash(t)


# --- routing ---------------------------------------------------------------------------------


def stored_batch(engine_hashes, tokens, parent=None, block_size=16):
    """A vLLM EventBatch (tagged-map events, as vLLM 0.33 publishes them) of one BlockStored."""
    event = {
        "type": "BlockStored",
        "block_hashes": engine_hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "medium": "GPU",
    }
    return msgpack.packb([1700000000.25, [event], 0])


def removed_batch(engine_hashes):
    return msgpack.packb(
        [1700000000.5, [{"type": "BlockRemoved", "block_hashes": engine_hashes, "medium": "GPU"}]]
    )


def prompt(tag, n):
    return [(tag * 7919 + i * 31) % 50_000 for i in range(n)]


def test_follow_up_goes_to_the_worker_holding_its_prefix():
    r = kvkit.Router(block_size=16)
    for w in ("w0", "w1", "w2"):
        assert r.add_worker(w)
    assert not r.add_worker("w1")
    assert r.workers() == ["w0", "w1", "w2"]
    conv = prompt(1, 64)  # 4 blocks the engine w2 has cached
    other = prompt(2, 64)
    s = r.apply_vllm_batch("w2", stored_batch([11, 12, 13, 14], conv))
    assert s["blocks_stored"] == 4 and s["seq"] == 0 and s["gap"] is None
    r.apply_vllm_batch("w0", stored_batch([21, 22, 23, 24], other))
    assert r.cache_view("w2") == 4 and r.cache_view("w1") == 0

    follow_up = conv + prompt(3, 40)  # the conversation's next turn
    d = r.route(1, follow_up)
    assert d.worker == "w2"
    assert d.cache_hits == 4
    assert d.request_blocks == 6
    assert d.cost == pytest.approx(1.0 * (6 - 4) + 0)
    assert d.candidates is None
    assert r.in_flight("w2") == 1 and r.active_blocks("w2") == 6
    r.prefill_done(1)
    r.prefill_done(1)  # a second call is a no-op
    r.finish(1)
    assert r.in_flight("w2") == 0

    # Removing the blocks on w2 (engine hashes) takes the hits away.
    s = r.apply_vllm_batch("w2", removed_batch([13, 14]), seq=1)
    assert s["blocks_removed"] == 2
    d = r.route(2, follow_up, explain=True)
    by_worker = {c.worker: c for c in d.candidates}
    assert by_worker["w2"].cache_hits == 2 and by_worker["w1"].cache_hits == 0
    assert d.worker == "w2" and d.cache_hits == 2


def test_vllm_fixture_payloads_and_multipart_messages():
    r = kvkit.Router(16)
    r.add_worker("w0")
    r.add_worker("w1")
    payload = (FIXTURES / "stored_positional_int.msgpack").read_bytes()
    s = r.apply_vllm_message("w1", [b"kv-events", (0).to_bytes(8, "big"), payload])
    assert s["blocks_stored"] == 4
    d = r.route(7, list(range(64)))
    assert (d.worker, d.cache_hits, d.cost) == ("w1", 4, 0.0)
    # SGLang's publisher writes the same wire.
    r.add_worker("sglang")
    s = r.apply_vllm_batch("sglang", (FIXTURES / "sglang_unsalted.msgpack").read_bytes())
    assert s["events"] >= 1


def test_a_gap_in_sequence_numbers_is_reported():
    r = kvkit.Router(16)
    r.add_worker("w")
    r.apply_vllm_batch("w", stored_batch([1], prompt(4, 16)), seq=0)
    s = r.apply_vllm_batch("w", stored_batch([2], prompt(5, 16)), seq=5)
    assert s["gap"] == (1, 5)


def test_own_events_and_salted_routes():
    r = kvkit.Router(block_size=4, policy="kv")
    r.add_worker("a")
    r.add_worker("b")
    tokens = list(range(8))
    blocks = kvkit.BlockHasher(4).hash(tokens, salt="my-lora")
    assert r.apply_event("b", 0, "stored", blocks) == {
        "gap": None, "stored": 2, "already_present": 0, "removed": 0, "unknown_removed": 0
    }
    base = r.route(1, tokens)
    lora = r.route(2, tokens, "my-lora")
    assert (base.cache_hits, lora.cache_hits, lora.worker) == (0, 2, "b")
    r.apply_event("b", 1, "removed", blocks[1:])
    assert r.cache_view("b") == 1
    r.apply_event("b", 2, "cleared")
    assert r.cache_view("b") == 0


def test_cache_salt_keys_the_first_block_as_vllm_does():
    r = kvkit.Router(16)
    r.add_worker("a")
    r.add_worker("b")
    tokens = prompt(9, 32)
    salted = kvkit.BlockHasher(16).hash(tokens, extra_keys=[["tenant-1"]])
    r.apply_event("b", 0, "stored", salted)
    assert r.route(1, tokens, cache_salt="tenant-1").cache_hits == 2
    assert r.route(2, tokens).cache_hits == 0


def test_policies_and_options():
    rr = kvkit.Router(4, policy="round_robin")
    for w in ("x", "y", "z"):
        rr.add_worker(w)
    picks = [rr.route(i, list(range(12))).worker for i in range(4)]
    assert picks == ["x", "y", "z", "x"]
    opts = kvkit.Router(
        16,
        "kv",
        2.0,
        prefill_overlap_weight=20.0,
        decode_overlap_weight=2.0,
        seed=7,
        cost_model="prefill-aware",
        temperature=0.5,
        busy_decode_fraction=0.9,
        busy_capacity_blocks=1000,
        busy_prefill_tokens=8192,
        predicted_ttl_s=2.0,
        host_hit_credit=0.5,
        tail_first_evictions=True,
    )
    opts.add_worker("a")
    opts.set_clock(1.5)
    assert opts.route(1, prompt(1, 48), role="prefill").request_blocks == 3
    assert "Router(block_size=16" in repr(opts)


def test_snapshot_and_restore():
    r = kvkit.Router(16)
    for w in ("w0", "w1"):
        r.add_worker(w)
    conv = prompt(6, 64)
    r.apply_vllm_batch("w1", stored_batch([1, 2, 3, 4], conv))
    snap = r.snapshot()
    assert isinstance(snap, bytes)
    again = kvkit.Router(16)
    again.add_worker("gone")
    again.restore(snap)
    assert again.workers() == ["w0", "w1"]
    assert again.cache_view("w1") == 4
    assert again.route(1, conv).worker == "w1"
    # The vLLM feed came along: the next batch is expected at seq 1, and removals map.
    s = again.apply_vllm_batch("w1", removed_batch([4]))
    assert (s["seq"], s["blocks_removed"]) == (1, 1)
    with pytest.raises(kvkit.SnapshotError):
        kvkit.Router(32).restore(snap)  # another block size
    with pytest.raises(kvkit.SnapshotError):
        again.restore(b"not a snapshot")


def test_shared_between_threads():
    r = kvkit.Router(16)
    for i in range(8):
        r.add_worker(f"w{i}")
    errors = []

    def work(t):
        try:
            for i in range(200):
                rid = t * 1000 + i
                r.route(rid, prompt(i % 5, 128))
                r.finish(rid)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sum(r.in_flight(f"w{i}") for i in range(8)) == 0


# --- bad input -------------------------------------------------------------------------------


def test_exception_classes():
    for cls in (kvkit.HashError, kvkit.RouteError, kvkit.EventError, kvkit.SnapshotError, kvkit.SimError):
        assert issubclass(cls, kvkit.KvkitError)
    assert issubclass(kvkit.KvkitError, ValueError)


def test_bad_input_raises_the_right_exception():
    with pytest.raises(kvkit.HashError, match="block size"):
        kvkit.BlockHasher(0)
    with pytest.raises(kvkit.HashError):
        kvkit.BlockHasher(-3)
    h = kvkit.BlockHasher(16)
    with pytest.raises(OverflowError):
        h.hash([-1] * 16)
    with pytest.raises(OverflowError):
        h.hash([2**32] * 16)
    with pytest.raises(OverflowError):
        h.hash([-1] * 100)
    with pytest.raises(TypeError):
        h.hash([1.5] * 100)
    with pytest.raises(TypeError):
        h.hash(b"\x00" * 10)  # not whole 4-byte ids
    with pytest.raises(TypeError):
        h.hash("sixteen tokens!!")
    with pytest.raises(TypeError):
        h.hash([1.5] * 16)
    with pytest.raises(kvkit.HashError, match="extra_keys"):
        h.hash(list(range(16)), extra_keys=[[object()]])
    with pytest.raises(kvkit.HashError):
        h.hash(list(range(16)), extra_keys=[[2**70]])
    deep = ()
    for _ in range(100):
        deep = (deep,)
    with pytest.raises(kvkit.HashError, match="nested"):
        h.hash(list(range(16)), extra_keys=[[deep]])

    with pytest.raises(kvkit.RouteError, match="policy"):
        kvkit.Router(16, policy="fastest")
    with pytest.raises(kvkit.RouteError, match="overlap weight"):
        kvkit.Router(16, overlap_weight=-1.0)
    with pytest.raises(kvkit.RouteError):
        kvkit.Router(16, overlap_weight=float("nan"))
    with pytest.raises(kvkit.RouteError):
        kvkit.Router(16, cost_model="cheap")
    with pytest.raises(kvkit.RouteError):
        kvkit.Router(16, predicted_ttl_s=-1.0)
    with pytest.raises(kvkit.RouteError, match="busy_capacity_blocks"):
        kvkit.Router(16, busy_decode_fraction=0.5)
    with pytest.raises(kvkit.RouteError):
        kvkit.Router(16, virtual_nodes=0)
    with pytest.raises(kvkit.HashError):
        kvkit.Router(0)

    r = kvkit.Router(16)
    with pytest.raises(kvkit.RouteError, match="no worker"):
        r.route(1, list(range(32)))
    r.add_worker("w")
    with pytest.raises(kvkit.RouteError, match="unknown worker"):
        r.cache_view("nobody")
    with pytest.raises(kvkit.RouteError, match="unknown worker"):
        r.apply_vllm_batch("nobody", stored_batch([1], prompt(1, 16)))
    r.route(1, list(range(32)))
    with pytest.raises(kvkit.RouteError, match="already in flight"):
        r.route(1, list(range(32)))
    with pytest.raises(kvkit.RouteError, match="not in flight"):
        r.finish(2)
    with pytest.raises(kvkit.RouteError, match="role"):
        r.route(3, list(range(32)), role="both")
    with pytest.raises(OverflowError):
        r.route(-1, list(range(32)))
    with pytest.raises(kvkit.EventError, match="block size"):
        r.apply_vllm_batch("w", stored_batch([1], prompt(1, 32), block_size=32))
    with pytest.raises(kvkit.EventError):
        r.apply_vllm_batch("w", b"\xc1garbage")
    with pytest.raises(kvkit.EventError):
        r.apply_vllm_batch("w", b"")
    with pytest.raises(kvkit.EventError):
        r.apply_vllm_message("w", [b"topic", b"short", b""])
    with pytest.raises(TypeError):
        r.apply_vllm_batch("w", "not bytes")
    for bad in sorted(FIXTURES.glob("bad_*.msgpack")):
        with pytest.raises(kvkit.EventError):
            r.apply_vllm_batch("w", bad.read_bytes())
    with pytest.raises(kvkit.EventError, match="kind"):
        r.apply_event("w", 0, "evicted", [1])
    with pytest.raises(kvkit.EventError):
        r.apply_event("w", 0, "cleared", [1])
    assert r.apply_event("w", 0, "stored", [1, 2])["stored"] == 2
    with pytest.raises(kvkit.EventError, match="already seen"):
        r.apply_event("w", 0, "stored", [3])
    with pytest.raises(kvkit.EventError, match="parent"):
        r.apply_event("w", 1, "stored", [5], parent=4)
    # The refused event used its id; a later id is applied with the gap reported.
    assert r.apply_event("w", 3, "cleared")["gap"] == (2, 3)
    # Nothing was applied by the refused calls.
    assert r.cache_view("w") == 0 and r.workers() == ["w"]


# --- simulating ------------------------------------------------------------------------------


def kvsim_cli(args):
    """The kvsim binary's stdout: $KVSIM if set (CI builds it), else through cargo."""
    exe = os.environ.get("KVSIM")
    cmd = [exe] if exe else ["cargo", "run", "-q", "-p", "kvsim-cli", "--bin", "kvsim", "--"]
    out = subprocess.run(cmd + args, cwd=REPO, check=True, capture_output=True, text=True)
    return out.stdout


def test_simulate_equals_the_cli_json():
    got = kvkit.simulate(**DOC)
    want = json.loads(kvsim_cli(kvkit.flags_to_argv(DOC) + ["--format", "json"]))
    assert got == want
    assert got["requests"] == 200 and got["instances"] == 4
    # And the library call returns the very bytes the command prints.
    assert kvkit.kvsim(*kvkit.flags_to_argv(DOC)) == kvsim_cli(kvkit.flags_to_argv(DOC))


def test_flags_to_argv():
    assert kvkit.flags_to_argv(
        dict(des_instances=8, des_router_sync=True, quiet=False, seed=None, busy_threshold=["decode=0.9", "prefill-tokens=4096"], des_overlap_weight=0.5)
    ) == [
        "--des-instances", "8", "--des-router-sync",
        "--busy-threshold", "decode=0.9,prefill-tokens=4096",
        "--des-overlap-weight", "0.5",
    ]
    assert kvkit.flags_to_argv({"requests_out": pathlib.Path("x.jsonl")}) == ["--requests-out", "x.jsonl"]
    with pytest.raises(TypeError):
        kvkit.flags_to_argv({"des_instances": {"a": 1}})


def test_sweep_capacity_and_bad_flags(tmp_path):
    rows = kvkit.sweep({"des_overlap_weight": [0, 1]}, des_num_requests=60, jobs=1)
    assert [r["value"] for r in rows] == ["0", "1"]
    assert rows == kvkit.sweep("des-overlap-weight=0,1", des_num_requests=60, jobs=1)
    cap = kvkit.capacity(slo_ttft_ms=2000, runs=2, probes=2, des_num_requests=60, jobs=1)
    assert cap["find"] == "rate" and len(cap["probes"]) == 2
    steps = tmp_path / "steps.csv"
    steps.write_text(
        "prefill_tokens,decode_requests,context_tokens,step_us\n"
        + "".join(f"{p},{d},{c},{500 + 0.05 * p + 20 * d + 0.01 * c}\n"
                  for p, d, c in [(0, 1, 100), (512, 0, 0), (256, 4, 900), (0, 8, 4000), (1024, 2, 300)])
    )
    fit = kvkit.calibrate(steps=steps)
    assert fit["base_us"] == pytest.approx(500, rel=1e-3)
    out = tmp_path / "reqs.jsonl"
    kvkit.simulate(des_num_requests=30, requests_out=out)
    assert len(out.read_text().splitlines()) == 30

    with pytest.raises(kvkit.SimError, match="--des-instances 0"):
        kvkit.simulate(des_instances=0)
    with pytest.raises(kvkit.SimError, match="unexpected argument"):
        kvkit.simulate(no_such_flag=1)
    with pytest.raises(kvkit.SimError):
        kvkit.simulate(des_routing="fastest")
    with pytest.raises(kvkit.SimError):
        kvkit.simulate(format="text")
    with pytest.raises(kvkit.SimError, match="capacity needs a target"):
        kvkit.capacity(des_num_requests=20)
    with pytest.raises(kvkit.SimError):
        kvkit.simulate(trace=tmp_path / "missing.jsonl")
    assert "Usage: kvsim" in kvkit.kvsim("--help")


def test_to_pandas():
    pd = pytest.importorskip("pandas")
    rows = kvkit.sweep({"des_overlap_weight": [0, 1]}, des_num_requests=40, jobs=1)
    df = kvkit.to_pandas(rows)
    assert list(df["value"]) == ["0", "1"]
    one = kvkit.to_pandas(kvkit.simulate(des_num_requests=40))
    assert len(one) == 1 and "ttft_ms.p50" in one.columns
    assert isinstance(df, pd.DataFrame)
