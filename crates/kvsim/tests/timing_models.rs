//! The polynomial (Dynamo mocker) timing model as the simulator uses it.

use kvsim::{PolynomialTiming, SimConfig, Simulation, StepShape, TimingKind, TimingModel};

fn one_request(kv_blocks: Option<usize>) -> kvsim::Report {
    let mut c = SimConfig::default();
    c.num_requests = 1;
    c.instances = 1;
    c.input_len = 1000;
    c.prefix_len = 0;
    c.output_len = 2;
    c.kv_blocks = kv_blocks;
    c.timing_kind = TimingKind::Polynomial;
    Simulation::new(c).unwrap().run().unwrap()
}

/// One request of 1,000 tokens and 2 output tokens, alone: its prefill is one step of 1,000
/// new tokens, 4.209989e-07 * 1000^2 + 1.518344e-02 * 1000 + 16.50142 = 32.1058589 ms
/// (32,106 µs); its second token one decode step at utilisation 1,001 / 460,800.
#[test]
fn a_lone_request_takes_the_published_polynomial() {
    let r = one_request(None);
    assert_eq!(r.ttft_ms.p50, 32.106);
    let u: f64 = 1001.0 / 460_800.0;
    let decode_us = ((5.74 + 54.01 * u - 25.74 * u * u) * 1e3).round();
    assert_eq!(r.e2e_ms.p50, (32_106.0 + decode_us) / 1e3);
    // Bounded engines measure utilisation against their own blocks: 100 blocks of 16 tokens.
    let r = one_request(Some(100));
    let u: f64 = 1001.0 / 1600.0;
    let decode_us = ((5.74 + 54.01 * u - 25.74 * u * u) * 1e3).round();
    assert_eq!(r.e2e_ms.p50, (32_106.0 + decode_us) / 1e3);
}

#[test]
fn polynomial_steps_sum_prefill_and_decode_and_floor_decode_at_1_ms() {
    let t = PolynomialTiming::with_capacity(10_000);
    let prefill = t.step_us(&StepShape::new(500, 0, 0));
    let decode = t.step_us(&StepShape::new(0, 3, 5_000));
    assert!(
        t.step_us(&StepShape::new(500, 3, 5_000))
            .abs_diff(prefill + decode)
            <= 1
    );
    // Far beyond capacity the quadratic turns negative: the step still takes 1 ms.
    assert_eq!(t.step_us(&StepShape::new(0, 3, 1_000_000)), 1_000);
    assert_eq!(t.step_us(&StepShape::new(0, 0, 0)), 0);
    let mut bad = PolynomialTiming::with_capacity(0);
    assert!(bad.validate().is_err());
    bad.kv_capacity_tokens = 1;
    assert!(bad.validate().is_ok());
}
