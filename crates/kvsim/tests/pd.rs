//! Disaggregated prefill/decode pools and router replicas.

use kvblock::BlockSize;
use kvsim::{Popularity, Report, SimConfig, Simulation};

fn pd(prefill_w: Option<f64>, decode_w: Option<f64>) -> SimConfig {
    let mut c = SimConfig::default();
    c.block_size = BlockSize::new(512).unwrap();
    c.prefill_instances = Some(4);
    c.decode_instances = Some(4);
    c.prefill_overlap_weight = prefill_w;
    c.decode_overlap_weight = decode_w;
    c.num_requests = 1200;
    c.request_rate = 16.0;
    c.num_prefixes = 12;
    c
}

fn run(c: SimConfig) -> Report {
    Simulation::new(c).unwrap().run().unwrap()
}

#[test]
fn pools_are_reported_separately_and_ttft_includes_the_transfer() {
    let r = run(pd(Some(20.0), Some(2.0)));
    let p = r.pd.as_ref().expect("disaggregated");
    assert_eq!(
        (p.prefill.instances, p.decode.instances, r.instances),
        (4, 4, 8)
    );
    assert_eq!(
        (p.prefill.overlap_weight, p.decode.overlap_weight),
        (20.0, 2.0)
    );
    assert_eq!(r.completed, 1200);
    assert!(p.transfer_ms.p50 > 0.1, "{:?}", p.transfer_ms);
    // A cold 4096-token prompt: 7.05 + 19.5 * 4096 us of prefill, then the transfer.
    assert!(r.ttft_ms.p99 > p.transfer_ms.p50);
    let text = r.to_text(true);
    assert!(
        text.starts_with(
            "  Fleet: 4 prefill + 4 decode instance(s), routing=kv | prefix pool: 12 prefixes\n"
        ),
        "{text}"
    );
    assert!(text.contains("  Prefill pool: weight 20, hit rate "));
    assert!(text.contains("  Decode pool: weight 2, hit rate "));
    assert!(text.contains("transfer p50 "));
    let json: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert!(json["pd"]["prefill"]["block_reuse"].as_f64().is_some());
    assert!(json["pd"]["decode"]["load_balance"].as_f64().is_some());
    assert!(json["pd"]["transfer_ms"]["p99"].as_f64().is_some());
    assert_eq!(json["per_instance"][7]["pool"], "decode");
}

#[test]
fn a_transfer_moves_only_the_blocks_the_decode_engine_lacks() {
    let mut c = pd(None, Some(1000.0));
    c.num_requests = 400;
    c.pd_transfer_gbps = 8.0; // 1 GB/s: a 4096-token prompt of 128 KiB/token takes 537 ms
    c.pd_transfer_latency_us = 0;
    let r = run(c);
    let p = r.pd.unwrap();
    let cold_ms = 4096.0 * 131_072.0 / 1e9 * 1e3;
    // Decode engines that already hold the prefix receive only the suffix: half the prompt.
    assert!(p.decode.block_reuse > 0.4, "{}", p.decode.block_reuse);
    assert!(
        (p.transfer_ms.p50 - cold_ms / 2.0).abs() < 1.0,
        "{:?}",
        p.transfer_ms
    );
    assert!(
        (p.transfer_ms.p99 - cold_ms).abs() < 1.0,
        "{:?}",
        p.transfer_ms
    );
}

#[test]
fn decode_weight_zero_balances_decode_load() {
    let mut balanced = pd(Some(20.0), Some(0.0));
    balanced.prefix_popularity = Popularity::Zipf(1.5);
    let mut sticky = balanced.clone();
    sticky.decode_overlap_weight = Some(1000.0);
    let (b, s) = (run(balanced), run(sticky));
    let (b, s) = (b.pd.unwrap(), s.pd.unwrap());
    assert!(b.decode.load_balance < 1.1, "{}", b.decode.load_balance);
    assert!(
        s.decode.load_balance > b.decode.load_balance,
        "{} vs {}",
        s.decode.load_balance,
        b.decode.load_balance
    );
}

#[test]
fn a_large_prefill_weight_concentrates_prefixes() {
    let (spread, local) = (
        run(pd(Some(0.0), Some(2.0))),
        run(pd(Some(1000.0), Some(2.0))),
    );
    let misses = |r: &Report| {
        let p = &r.pd.as_ref().unwrap().prefill;
        r.completed - (p.request_hit_rate * r.completed as f64).round() as usize
    };
    // Weight 1000: each prefix lives on about one prefill engine (a second request that arrives
    // before the first is cached may start it elsewhere); weight 0: on every engine.
    assert!((12..=16).contains(&misses(&local)), "{}", misses(&local));
    assert!(
        misses(&spread) > 3 * misses(&local),
        "{} vs {}",
        misses(&spread),
        misses(&local)
    );
}

#[test]
fn shared_weight_against_per_role_weights() {
    // The source document's typical per-role weights against one shared weight of 1.
    let shared = run(pd(None, None)).pd.unwrap();
    let per_role = run(pd(Some(20.0), Some(2.0))).pd.unwrap();
    assert_eq!(
        (shared.prefill.overlap_weight, shared.decode.overlap_weight),
        (1.0, 1.0)
    );
    assert!(per_role.prefill.block_reuse >= shared.prefill.block_reuse);
}

/// The single-router report, byte for byte as the simulator printed it before router replicas
/// and disaggregation existed (that commit's `kvsim --des-kv-blocks 3000 --des-num-requests 600
/// --request-rate 20`). One replica with no event delay must stay exactly that run. A deliberate
/// change to the engine or timing model changes these figures: update them with the change.
const SINGLE_ROUTER: &str = "  Fleet: 4 instance(s), routing=kv | prefix pool: 8 prefixes
  KV block cache: block_size=16 tok, capacity/instance=3000, evictions=74392, block-reuse=44.3%
  Prefix-cache hit rate: 89.0% of requests (avg 1816 cached tok/req; per-instance 87–91%)
  Requests: 600 completed, 0 rejected | makespan 34.42 s | throughput 17.43 req/s, 4462 output tok/s
  TTFT ms: mean 1051.5, p50 913.2, p90 2233.8, p99 2949.9
  ITL  ms: mean 12.1, p50 10.0, p90 10.2, p99 87.5
  E2E  ms: mean 4128.9, p50 4043.8, p90 5158.7, p99 5665.9
  Load balance: max/mean requests per instance 1.01 (min 149, max 152)
";

#[test]
fn one_router_replica_is_the_single_router_run_byte_for_byte() {
    let mut c = SimConfig::default();
    c.kv_blocks = Some(3000);
    c.num_requests = 600;
    c.request_rate = 20.0;
    c.routers = 1;
    c.event_delay_us = 0;
    assert_eq!(run(c.clone()).to_text(false), SINGLE_ROUTER);
    c.routers = 4;
    let four = run(c.clone());
    assert_eq!(four.routers, 4);
    assert!(four
        .to_text(false)
        .starts_with("  Fleet: 4 instance(s), routing=kv, 4 routers | "));
    assert_ne!(four.to_text(false), SINGLE_ROUTER);
    assert_eq!(
        four.to_json(),
        run(c).to_json(),
        "replicas are deterministic too"
    );
}

#[test]
fn replicas_that_cannot_see_each_others_load_lose_balance() {
    let mut c = SimConfig::default();
    c.block_size = BlockSize::new(512).unwrap();
    c.num_requests = 1500;
    c.request_rate = 20.0;
    c.instances = 8;
    c.overlap_weight = 0.0; // pure load balancing: only the load view matters
    let one = run(c.clone());
    c.routers = 8;
    let eight = run(c);
    assert!(
        one.load_balance <= eight.load_balance,
        "{} vs {}",
        one.load_balance,
        eight.load_balance
    );
}

#[test]
fn pd_settings_are_validated() {
    let mut c = SimConfig::default();
    c.prefill_instances = Some(2);
    assert_eq!(
        Simulation::new(c.clone()).unwrap_err().to_string(),
        "invalid decode_instances unset: expected both prefill_instances and decode_instances, or neither"
    );
    c.decode_instances = Some(0);
    assert!(Simulation::new(c.clone())
        .unwrap_err()
        .to_string()
        .contains("decode_instances 0"));
    c.decode_instances = Some(1);
    c.pd_transfer_gbps = 0.0;
    assert!(Simulation::new(c.clone())
        .unwrap_err()
        .to_string()
        .contains("pd_transfer_gbps 0"));
    c.pd_transfer_gbps = 1.0;
    c.routers = 0;
    assert!(Simulation::new(c)
        .unwrap_err()
        .to_string()
        .contains("routers 0"));
}

/// Scoring has one home, kvroute: the simulator routes both sides through `kvroute::Router` and
/// holds no cost formula of its own.
#[test]
fn the_simulator_has_no_scoring_of_its_own() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut stack = vec![src];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for needle in [
                "fn cost(",
                "request_blocks - ",
                "overlap_weight *",
                "weight * (",
                ".overlaps(",
            ] {
                assert!(
                    !text.contains(needle),
                    "{} contains {needle:?}: scoring belongs in kvroute",
                    path.display()
                );
            }
        }
    }
}

/// Two 1,024-token prompts arrive together on one prefill engine, which prefills them one
/// step after the other (27,018 us each: 7,050 + 19.5 x 1,024), and send their KV to an empty
/// decode engine: 1,024 x 131,072 bytes x 8 = 1,073,741,824 bits each over 10 Gb/s (10,000
/// bits/us). Alone, a transfer takes round(107,374.2) = 107,374 us (+ 100 us latency).
/// Sharing the link (durations rounded to whole microseconds, as a lone transfer's):
/// - the first starts at 27,018 and has 803,561,824 bits left when the second starts at 54,036;
/// - at 5,000 bits/us each, the first ends after round(160,712.4) = 160,712 us, at 214,748;
/// - the second, alone again, has 270,181,824 bits left: round(27,018.2) = 27,018 us more, to
///   241,766.
///
/// Both take 187,830 us with the latency. A third request, 5 s later, is alone on the link.
#[test]
fn a_shared_link_splits_its_bandwidth_among_concurrent_transfers() {
    let line = |ts: u64, id: u64| {
        format!(
            r#"{{"timestamp": {ts}, "input_length": 1024, "output_length": 2, "hash_ids": [{id}, {}]}}"#,
            id + 1
        )
    };
    let text = [line(0, 10), line(0, 20), line(5_000, 30)].join("\n");
    let trace = kvsim::Trace::parse("t.jsonl", &text, BlockSize::new(512).unwrap()).unwrap();
    let mut c = SimConfig::default().with_trace(trace);
    c.prefill_instances = Some(1);
    c.decode_instances = Some(1);
    c.pd_transfer_gbps = 10.0;
    let dedicated = run(c.clone()).pd.unwrap().transfer_ms;
    assert_eq!(
        (dedicated.p50, dedicated.p99, dedicated.mean),
        (107.474, 107.474, 107.474)
    );
    c.pd_link = kvsim::PdLink::Shared;
    let shared = run(c).pd.unwrap().transfer_ms;
    // Nearest rank over [107.474, 187.83, 187.83].
    assert_eq!((shared.p50, shared.p99), (187.83, 187.83));
    assert!(
        (shared.mean - (107.474 + 2.0 * 187.83) / 3.0).abs() < 1e-9,
        "{shared:?}"
    );
}
