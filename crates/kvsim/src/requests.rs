//! A run's request stream with its prompt *content*, for tools that send the same traffic to a
//! live endpoint (`kvload`), and a [`Report`] from what such a tool measured.
//!
//! The simulator itself only needs block hashes; a load generator needs the tokens behind them.
//! [`workload_requests`] gives, for the same settings, the same requests the simulator runs (the
//! same arrival times, lengths and, for the synthetic pool, the very tokens whose block hashes
//! the simulator uses: a test checks it), so a live run and a simulated run see one stream.

use kvblock::BlockHash;

use crate::config::{Popularity, SimConfig};
use crate::records::{EngineRecord, MeasuredRequest, Records, RequestRecord};
use crate::report::Report;
use crate::rng::{SimRng, Zipf};
use crate::workload::{Arrivals, Workload};
use crate::Pool;

/// Token ids of the synthetic pool are drawn below this (as the simulator's workload does).
const VOCAB: u64 = 128_000;

/// What a request's prompt is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PromptContent {
    /// The prompt's tokens (the synthetic prefix pool).
    Tokens(Vec<u32>),
    /// A trace's prefix-chained block ids: `ids` name the full blocks of
    /// [`Trace::block_size`](crate::Trace::block_size) tokens, `partial` the last, partial one
    /// (if the trace gave it). Equal ids stand for equal token blocks.
    TraceIds {
        /// Ids of the full blocks, in order.
        ids: Vec<u64>,
        /// Id of the partial last block.
        partial: Option<u64>,
        /// Tokens per block of the ids.
        block_size: usize,
    },
}

/// One request of a run, as the simulator would see it arrive.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkloadRequest {
    /// Arrival time, microseconds from the first request.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub input_len: usize,
    /// Output tokens.
    pub output_len: usize,
    /// The prompt's content.
    pub content: PromptContent,
}

/// The requests a [`Simulation`](crate::Simulation) of `cfg` runs, in arrival order, with their
/// content, and the report's description of it (e.g. `prefix pool: 8 prefixes`).
///
/// ```
/// use kvsim::{PromptContent, SimConfig};
/// let mut cfg = SimConfig::default();
/// cfg.num_requests = 3;
/// let (reqs, content) = kvsim::workload_requests(&cfg);
/// assert_eq!((reqs.len(), content.as_str()), (3, "prefix pool: 8 prefixes"));
/// assert!(matches!(&reqs[0].content, PromptContent::Tokens(t) if t.len() == cfg.input_len));
/// ```
pub fn workload_requests(cfg: &SimConfig) -> (Vec<WorkloadRequest>, String) {
    let mut workload = Workload::new(cfg);
    let content = workload.describe();
    if let Some(trace) = &cfg.trace {
        let bs = trace.block_size().get();
        let mut out = Vec::with_capacity(cfg.request_count());
        let mut i = 0;
        while let Some(spec) = workload.next_request() {
            let partial = trace
                .requests()
                .get(i)
                .and_then(|r| r.partial)
                .map(BlockHash::get);
            out.push(WorkloadRequest {
                arrival_us: spec.arrival_us,
                input_len: spec.input_len,
                output_len: spec.output_len,
                content: PromptContent::TraceIds {
                    ids: spec.blocks.iter().map(|b| b.get()).collect(),
                    partial,
                    block_size: bs,
                },
            });
            i += 1;
        }
        return (out, content);
    }
    (synthetic_with_tokens(cfg), content)
}

/// The synthetic workload's requests with their tokens: the same random streams, in the same
/// order, as `workload::Synthetic` draws them.
fn synthetic_with_tokens(cfg: &SimConfig) -> Vec<WorkloadRequest> {
    let mut content = SimRng::new(cfg.seed, 1);
    let prefixes: Vec<Vec<u32>> = (0..cfg.num_prefixes)
        .map(|_| {
            (0..cfg.prefix_len)
                .map(|_| content.below(VOCAB) as u32)
                .collect()
        })
        .collect();
    let zipf = match cfg.prefix_popularity {
        Popularity::Uniform => None,
        Popularity::Zipf(s) => Some(Zipf::new(cfg.num_prefixes, s)),
    };
    let mut arrivals = Arrivals::new(
        cfg.arrival_model,
        cfg.request_rate,
        cfg.arrival_cv,
        SimRng::new(cfg.seed, 2),
    );
    let mut choose = SimRng::new(cfg.seed, 3);
    let input_len = cfg.input_len.max(cfg.prefix_len);
    (0..cfg.num_requests as u64)
        .map(|i| {
            let arrival_us = arrivals.next_us();
            let p = match &zipf {
                Some(z) => z.sample(&mut choose),
                None => choose.below(prefixes.len() as u64) as usize,
            };
            let mut suffix_rng = SimRng::new(cfg.seed, 1_000 + i);
            let mut tokens = prefixes[p].clone();
            tokens.extend((tokens.len()..input_len).map(|_| suffix_rng.below(VOCAB) as u32));
            WorkloadRequest {
                arrival_us,
                input_len,
                output_len: cfg.output_len,
                content: PromptContent::Tokens(tokens),
            }
        })
        .collect()
}

/// The simulator's [`Report`] over measured requests of one endpoint (seen as one instance):
/// hit rate and block reuse from the cached tokens at `cfg.block_size`, latencies from the
/// times. `itl_us` holds every inter-token gap measured.
pub fn measured_report(
    cfg: &SimConfig,
    content: String,
    requests: &[MeasuredRequest],
    itl_us: &[u64],
) -> Report {
    let bs = cfg.block_size;
    let records = Records {
        requests: requests
            .iter()
            .map(|m| RequestRecord {
                arrival: m.arrival_us,
                input: m.input_len,
                output: m.output_len,
                prompt_blocks: bs.full_blocks(m.input_len),
                engine: 0,
                hits: m.cached_tokens / bs.get(),
                decode_engine: None,
                decode_hits: 0,
                host_hits: 0,
                scheduled: m.arrival_us,
                transfer_us: 0,
                first_token: m.first_token_us.max(m.arrival_us),
                finish: m.finish_us.max(m.first_token_us).max(m.arrival_us),
                rejected: m.failed,
                turn: 1,
                preemptions: m.preemptions.unwrap_or(0),
            })
            .collect(),
        engines: vec![EngineRecord {
            pool: Pool::Unified,
            evictions: 0,
            resident_blocks: 0,
            host_blocks: 0,
            busy_us: 0,
            preemptions: 0,
            recomputed_tokens: 0,
        }],
        itl: itl_us.iter().map(|&g| (g, 1)).collect(),
        router_errors: 0,
        inconsistent_inserts: 0,
        sessions: None,
    };
    let cfg = SimConfig {
        instances: 1,
        prefill_instances: None,
        decode_instances: None,
        ..cfg.clone()
    };
    Report::build(&cfg, content, records)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvblock::{BlockHasher, BlockSize};

    /// The tokens given out hash to exactly the blocks the simulator routes, at the same times.
    #[test]
    fn synthetic_tokens_match_the_simulated_workload() {
        for (popularity, bs, prefix) in [
            (Popularity::Uniform, 16, 40),
            (Popularity::Zipf(1.1), 64, 300),
        ] {
            let cfg = SimConfig {
                num_prefixes: 5,
                prefix_len: prefix,
                input_len: 333,
                block_size: BlockSize::new(bs).unwrap(),
                num_requests: 40,
                prefix_popularity: popularity,
                seed: 7,
                ..SimConfig::default()
            };
            let (reqs, _) = workload_requests(&cfg);
            let mut w = Workload::new(&cfg);
            let hasher = BlockHasher::new(cfg.block_size);
            for r in &reqs {
                let spec = w.next_request().unwrap();
                let PromptContent::Tokens(t) = &r.content else {
                    panic!("synthetic content has tokens")
                };
                assert_eq!(hasher.sequence_hashes(t), spec.blocks);
                assert_eq!(
                    (r.arrival_us, r.input_len, r.output_len),
                    (spec.arrival_us, spec.input_len, spec.output_len)
                );
            }
            assert!(w.next_request().is_none());
        }
    }

    #[test]
    fn trace_requests_keep_ids_and_times() {
        let text = r#"{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [7, 8, 9]}
{"timestamp": 10, "input_length": 32, "output_length": 3, "hash_ids": [7, 8]}"#;
        let trace = crate::Trace::parse("t", text, BlockSize::new(16).unwrap()).unwrap();
        let cfg = SimConfig {
            trace_speedup: 2.0,
            ..SimConfig::default().with_trace(trace)
        };
        let (reqs, content) = workload_requests(&cfg);
        assert_eq!(content, "trace: t (2 requests)");
        assert_eq!(
            reqs[0].content,
            PromptContent::TraceIds {
                ids: vec![7, 8],
                partial: Some(9),
                block_size: 16
            }
        );
        assert_eq!((reqs[1].arrival_us, reqs[1].output_len), (5_000, 3));
    }

    #[test]
    fn measured_report_counts_hits_and_failures() {
        let cfg = SimConfig {
            block_size: BlockSize::new(16).unwrap(),
            ..SimConfig::default()
        };
        let reqs = [
            MeasuredRequest::new(0, 64, 4, 32, 10_000, 40_000),
            MeasuredRequest::new(1_000, 64, 4, 0, 21_000, 51_000),
            MeasuredRequest::failed(2_000, 64),
        ];
        let r = measured_report(&cfg, "live".into(), &reqs, &[10_000; 6]);
        assert_eq!((r.completed, r.rejected), (2, 1));
        assert_eq!(r.request_hit_rate, 0.5);
        assert_eq!(r.block_reuse, 2.0 / 8.0);
        assert_eq!(r.ttft_ms.p99, 20.0);
        assert_eq!(r.itl_ms.p50, 10.0);
    }
}
