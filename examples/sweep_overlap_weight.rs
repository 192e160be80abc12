//! Sweep the kv policy's overlap weight on a synthetic workload with hot prefixes, to see the
//! locality-versus-balance trade-off the weight dials.
//!
//! `cargo run --release --example sweep_overlap_weight`
//!
//! For the same from the command line, with a chart: `kvsim sweep --param
//! des-overlap-weight=0,0.25,0.5,1,2,4,8 --prefix-popularity zipf:1.2 --des-num-prefixes 16
//! --des-instances 8 --request-rate 40 --des-num-requests 2000 --des-kv-blocks 4000 --plot sweep.svg`.

use kvkit::kvsim::{Popularity, SimConfig, Simulation};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut base = SimConfig::default();
    base.num_requests = 2_000;
    base.request_rate = 40.0;
    base.instances = 8;
    base.num_prefixes = 16;
    base.prefix_popularity = Popularity::Zipf(1.2);
    base.kv_blocks = Some(4_000);

    println!("  weight  hit-rate  block-reuse  balance  TTFT p50  TTFT p99");
    for weight in [0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0] {
        let mut cfg = base.clone();
        cfg.overlap_weight = weight;
        let r = Simulation::new(cfg)?.run()?;
        println!(
            "  {weight:>6}  {:>7.1}%  {:>10.1}%  {:>7.2}  {:>5.0} ms  {:>5.0} ms{}",
            r.request_hit_rate * 100.0,
            r.block_reuse * 100.0,
            r.load_balance,
            r.ttft_ms.p50,
            r.ttft_ms.p99,
            if r.hot_spot { "  hot spot" } else { "" }
        );
    }
    Ok(())
}
