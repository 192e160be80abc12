//! Reports are a contract: every figure and JSON field stays byte-identical unless an issue
//! changes the model. Each case pins the XXH3-64 of the full JSON report (and of the verbose
//! text) of one configuration that exercises a distinct path of the simulator: bounded caches
//! with eviction, delayed events, router replicas, disaggregated pools, every policy, traces.
//! Update a constant only with a deliberate change to the model, and say so in the changelog.

use kvblock::BlockSize;
use kvsim::{ArrivalModel, Policy, Popularity, SimConfig, Simulation, Trace};
use xxhash_rust::xxh3::xxh3_64;

fn bs(n: usize) -> BlockSize {
    BlockSize::new(n).unwrap()
}

/// A small prefix-chained trace with repeated conversations, made here so the test needs no file.
fn trace() -> Trace {
    let mut lines = Vec::new();
    for i in 0u64..240 {
        let conv = i % 7;
        let turn = i / 7;
        let blocks = 2 + (turn % 5);
        let ids: Vec<String> = (0..blocks)
            .map(|b| (if b == 0 { 0 } else { conv * 100 + b }).to_string())
            .collect();
        lines.push(format!(
            r#"{{"timestamp": {}, "input_length": {}, "output_length": {}, "hash_ids": [{}]}}"#,
            i * 37,
            blocks * 64 - (i % 3) * 10,
            1 + (i * 13) % 90,
            ids.join(", ")
        ));
    }
    Trace::parse("golden.jsonl", &lines.join("\n"), bs(64)).unwrap()
}

fn cases() -> Vec<(&'static str, SimConfig)> {
    let base = SimConfig::default();
    let mut v = vec![("default", base.clone())];
    let mut c = base.clone();
    c.block_size = bs(512);
    v.push(("source document, block 512", c));
    let mut c = base.clone();
    c.num_requests = 400;
    c.request_rate = 20.0;
    c.kv_blocks = Some(1500);
    c.prefix_popularity = Popularity::Zipf(1.1);
    c.num_prefixes = 16;
    v.push(("bounded, zipf", c));
    for policy in Policy::ALL {
        let mut c = base.clone();
        c.num_requests = 150;
        c.routing = policy;
        c.kv_blocks = Some(2000);
        c.arrival_model = ArrivalModel::Gamma;
        c.arrival_cv = 2.0;
        c.prefix_aware_blocks = 2;
        v.push((policy.name(), c));
    }
    let mut c = base.clone();
    c.num_requests = 300;
    c.event_delay_us = 20_000;
    c.routers = 3;
    c.kv_blocks = Some(1200);
    c.request_rate = 15.0;
    v.push(("delayed events, 3 routers", c));
    let mut c = base.clone();
    c.prefill_instances = Some(2);
    c.decode_instances = Some(3);
    c.prefill_overlap_weight = Some(20.0);
    c.decode_overlap_weight = Some(2.0);
    c.kv_blocks = Some(1000);
    c.num_requests = 250;
    c.request_rate = 10.0;
    c.output_len = 40;
    c.event_delay_us = 3_000;
    v.push(("disaggregated", c));
    let mut c = base.clone();
    c.prefill_instances = Some(1);
    c.decode_instances = Some(1);
    c.kv_blocks = Some(256);
    c.num_requests = 60;
    c.output_len = 1;
    c.max_num_seqs = 3;
    c.routers = 2;
    v.push(("disaggregated, decode rejects all", c.clone()));
    c.kv_blocks = Some(257);
    c.output_len = 2;
    c.num_requests = 120;
    v.push(("disaggregated, tiny", c));
    let mut c = base.clone().with_trace(trace());
    c.instances = 3;
    c.kv_blocks = Some(7);
    c.max_batched_tokens = 256;
    c.max_num_seqs = 4;
    v.push(("trace, bounded", c));
    let mut c = base.with_trace(trace());
    c.trace_speedup = 4.0;
    c.routing = Policy::PrefixAware;
    v.push(("trace, fast", c));
    v
}

/// (case, XXH3-64 of `to_json()`, XXH3-64 of `to_text(true)`), as the simulator printed them
/// before the engine state machine was extracted from the event loop.
const PINNED: &[(&str, u64, u64)] = &[
    ("default", 0x23c2cd123d74bfb7, 0x5f652defc888af95),
    (
        "source document, block 512",
        0xdfc9ce4381b5a5a2,
        0x258dc3c5bce47bc7,
    ),
    ("bounded, zipf", 0xda48f64224d30241, 0x17234d218e3dbf55),
    ("kv", 0xb0214dc49b0927fc, 0x744098da0d74f8a9),
    ("prefix_aware", 0x39fdf168db6be996, 0x374226a0d16ffee7),
    ("round_robin", 0x60c82a1854d2ef63, 0x92f220ccfe7b5fbd),
    ("random", 0x4da5ea7d4e07dbb2, 0xf210dab00acea57f),
    (
        "delayed events, 3 routers",
        0x6422c8fb75e83c55,
        0x08bcb09500244269,
    ),
    ("disaggregated", 0x82a90f76c6e1ce1e, 0xac33e27272fc1a4c),
    (
        "disaggregated, decode rejects all",
        0x19eeeeb5206ed74a,
        0x21dd1f9eaed2b93f,
    ),
    (
        "disaggregated, tiny",
        0x546974ed3ca50374,
        0x9dc6275164415eaa,
    ),
    ("trace, bounded", 0x1255a6e427158491, 0xa4fa22095746f81a),
    ("trace, fast", 0x730755e23de70f02, 0xcf40219313af936f),
];

#[test]
fn reports_are_byte_identical_to_the_pinned_ones() {
    let got: Vec<(&str, u64, u64)> = cases()
        .into_iter()
        .map(|(name, cfg)| {
            let r = Simulation::new(cfg).unwrap().run().unwrap();
            (
                name,
                xxh3_64(r.to_json().as_bytes()),
                xxh3_64(r.to_text(true).as_bytes()),
            )
        })
        .collect();
    for g in &got {
        // The lines to paste into PINNED after a deliberate model change.
        println!("    ({:?}, {:#018x}, {:#018x}),", g.0, g.1, g.2);
    }
    assert_eq!(got, PINNED);
}
