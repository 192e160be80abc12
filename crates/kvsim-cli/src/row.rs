//! One row of a sweep: the figures of one run, as the table, CSV, JSON and chart show them.

use kvsim::Report;
use serde::Serialize;

/// One row of the sweep table.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Row {
    pub(crate) param: String,
    pub(crate) value: String,
    pub(crate) request_hit_rate: f64,
    pub(crate) block_reuse: f64,
    pub(crate) per_instance_hit_rate_min: f64,
    pub(crate) per_instance_hit_rate_max: f64,
    pub(crate) load_balance: f64,
    pub(crate) ttft_p50_ms: f64,
    pub(crate) ttft_p99_ms: f64,
    pub(crate) itl_p99_ms: f64,
    pub(crate) makespan_s: f64,
    pub(crate) evictions: u64,
    pub(crate) completed: usize,
    pub(crate) rejected: usize,
    /// Disaggregated runs: the decode pool's block reuse (blocks not transferred) and balance.
    pub(crate) decode_block_reuse: Option<f64>,
    pub(crate) decode_load_balance: Option<f64>,
    pub(crate) transfer_p99_ms: Option<f64>,
    /// With latency targets: the share of requests within all of them, and the goodput.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) slo_attainment: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) goodput_rps: Option<f64>,
}

impl Row {
    pub(crate) fn new(param: &str, value: &str, r: &Report) -> Self {
        Row {
            param: param.to_string(),
            value: value.to_string(),
            request_hit_rate: r.request_hit_rate,
            block_reuse: r.block_reuse,
            per_instance_hit_rate_min: r.per_instance_hit_rate_min,
            per_instance_hit_rate_max: r.per_instance_hit_rate_max,
            load_balance: r.load_balance,
            ttft_p50_ms: r.ttft_ms.p50,
            ttft_p99_ms: r.ttft_ms.p99,
            itl_p99_ms: r.itl_ms.p99,
            makespan_s: r.makespan_s,
            evictions: r.evictions,
            completed: r.completed,
            rejected: r.rejected,
            decode_block_reuse: r.pd.as_ref().map(|p| p.decode.block_reuse),
            decode_load_balance: r.pd.as_ref().map(|p| p.decode.load_balance),
            transfer_p99_ms: r.pd.as_ref().map(|p| p.transfer_ms.p99),
            slo_attainment: r.slo.as_ref().map(|s| s.attainment),
            goodput_rps: r.slo.as_ref().map(|s| s.goodput_rps),
        }
    }
}
