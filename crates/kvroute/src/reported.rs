//! What an engine reports of its own load (vLLM's `/metrics`: requests running and waiting, KV
//! cache usage), which the busy thresholds read next to the router's own counts (see
//! [`Router::set_reported_load`](crate::Router::set_reported_load)).

/// An engine's own view of its load, as its metrics report it.
///
/// ```
/// use kvroute::ReportedLoad;
/// let l = ReportedLoad::new(12, 3, 0.92);
/// assert_eq!((l.running, l.waiting, l.kv_usage), (12, 3, 0.92));
/// assert_eq!(ReportedLoad::default().kv_usage, 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct ReportedLoad {
    /// Requests in the engine's running batch (vLLM's `num_requests_running`).
    pub running: usize,
    /// Requests queued in the engine (vLLM's `num_requests_waiting`).
    pub waiting: usize,
    /// The share of its KV cache in use, 0 to 1 (vLLM's `kv_cache_usage_perc`, a fraction
    /// despite its name).
    pub kv_usage: f64,
}

impl ReportedLoad {
    /// `running` and `waiting` requests, `kv_usage` of the KV cache in use (a fraction).
    pub fn new(running: usize, waiting: usize, kv_usage: f64) -> Self {
        ReportedLoad {
            running,
            waiting,
            kv_usage,
        }
    }
}
