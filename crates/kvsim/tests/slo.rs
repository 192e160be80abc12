//! Latency targets: attainment and goodput are additive to the report and agree with it.

use kvsim::{SimConfig, Simulation, Slo};

fn cfg() -> SimConfig {
    let mut c = SimConfig::default();
    c.num_requests = 300;
    c.request_rate = 20.0;
    c.kv_blocks = Some(3000);
    c
}

#[test]
fn without_targets_the_report_has_no_slo_part() {
    let r = Simulation::new(cfg()).unwrap().run().unwrap();
    assert!(r.slo.is_none());
    assert!(!r.to_json().contains("\"slo\""));
    assert!(!r.to_text(true).contains("SLO"));
}

#[test]
fn targets_add_their_part_and_change_nothing_else() {
    let plain = Simulation::new(cfg()).unwrap().run().unwrap();
    let mut c = cfg();
    c.slo = Slo::new(Some(plain.ttft_ms.p50), Some(50.0), Some(1e9));
    let mut r = Simulation::new(c).unwrap().run().unwrap();
    let slo = r.slo.take().unwrap();
    assert_eq!(r, plain, "a target changes only the slo part");
    // Nearest-rank p50: at least half the requests are within it, not all of them here.
    let ttft = slo.ttft_attainment.unwrap();
    assert!((0.5..1.0).contains(&ttft), "{ttft}");
    assert_eq!(slo.e2e_attainment, Some(1.0));
    assert!(slo.attainment <= ttft.min(slo.itl_attainment.unwrap()));
    assert_eq!(slo.met as f64 / r.requests as f64, slo.attainment);
    assert!((slo.goodput_rps - slo.met as f64 / r.makespan_s).abs() < 1e-12);
}

#[test]
fn loose_targets_are_all_met_and_goodput_is_throughput() {
    let mut c = cfg();
    c.slo = Slo::new(Some(1e9), Some(1e9), Some(1e9));
    let r = Simulation::new(c).unwrap().run().unwrap();
    let slo = r.slo.as_ref().unwrap();
    assert_eq!((slo.attainment, slo.met), (1.0, r.completed));
    assert_eq!(slo.goodput_rps, r.throughput_rps);
    let mut c = cfg();
    c.slo = Slo::new(Some(0.001), None, None);
    let r = Simulation::new(c).unwrap().run().unwrap();
    assert_eq!(r.slo.unwrap().met, 0);
}

#[test]
fn bad_targets_are_refused_by_name() {
    let mut c = cfg();
    c.slo = Slo::new(None, Some(f64::NAN), None);
    let e = Simulation::new(c).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid slo.itl_ms NaN: expected a finite number of ms > 0"
    );
}
