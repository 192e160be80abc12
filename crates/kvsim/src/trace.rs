//! Mooncake-format request traces: loading, validation and statistics.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use kvblock::{BlockHash, BlockSize};
use serde_json::Value;

use crate::error::{Error, TraceError};
use crate::stats::nearest_rank;

/// Prompt and output lengths above this many tokens are refused (a trace refuses them too).
pub const MAX_TOKENS: usize = 1 << 24;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TraceRequest {
    /// Arrival time, microseconds from the trace's first request.
    pub arrival_us: u64,
    /// Prompt tokens.
    pub input_len: usize,
    /// Output tokens.
    pub output_len: usize,
    /// Block ids of the prompt's full blocks (a partial last block is not cacheable, so its id
    /// is dropped).
    pub blocks: Vec<BlockHash>,
    /// The id of a partial last block, if the trace gave one (not cacheable).
    pub partial: Option<BlockHash>,
}

/// A request trace in the Mooncake JSONL format: one JSON object per line with `timestamp`
/// (ms), `input_length`, `output_length` and `hash_ids` (prefix-chained ids of fixed-size token
/// blocks). Unknown fields are ignored; blank lines are skipped.
///
/// Loading checks every line before anything is simulated: bad JSON, a missing field, a negative
/// or non-integer length, more ids than the length allows, timestamps going backwards, and an id
/// that follows different parents on different lines (ids must be prefix-chained).
///
/// ```
/// use kvblock::BlockSize;
/// let text = r#"{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}
/// {"timestamp": 5, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 2], "extra": true}"#;
/// let trace = kvsim::Trace::parse("demo.jsonl", text, BlockSize::new(512)?)?;
/// assert_eq!(trace.requests().len(), 2);
/// assert_eq!(trace.requests()[1].arrival_us, 5_000);
/// assert_eq!(trace.requests()[1].blocks.len(), 2); // 1,100 tokens: two full blocks
///
/// let bad = r#"{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}"#;
/// let e = kvsim::Trace::parse("bad.jsonl", bad, BlockSize::new(512)?).unwrap_err();
/// assert_eq!(e.to_string(), "bad.jsonl:1: input_length: expected a whole number from 0 to 16777216, got -3");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    name: String,
    block_size: BlockSize,
    requests: Vec<TraceRequest>,
}

impl Trace {
    /// Tokens per block of the Mooncake traces' hash ids.
    pub const MOONCAKE_BLOCK_SIZE: usize = 512;

    /// Reads and checks a trace file whose ids name blocks of `block_size` tokens.
    pub fn load(path: &Path, block_size: BlockSize) -> Result<Self, Error> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| TraceError {
            file: file.clone(),
            line: 0,
            what: format!("cannot read: {e}"),
        })?;
        Self::parse(&file, &text, block_size)
    }

    /// Parses and checks trace text; `name` is used in errors and reports.
    pub fn parse(name: &str, text: &str, block_size: BlockSize) -> Result<Self, Error> {
        let err = |line: usize, what: String| {
            Error::Trace(TraceError {
                file: name.to_string(),
                line,
                what,
            })
        };
        let mut requests = Vec::new();
        let mut first_ms: Option<f64> = None;
        let mut last_ms = f64::NEG_INFINITY;
        // id -> (parent id, line first seen), to check that ids are prefix-chained.
        let mut parents: HashMap<u64, (Option<u64>, usize)> = HashMap::new();
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            if raw.trim().is_empty() {
                continue;
            }
            let v: Value =
                serde_json::from_str(raw).map_err(|e| err(line, format!("bad JSON: {e}")))?;
            let obj = v
                .as_object()
                .ok_or_else(|| err(line, "expected a JSON object".to_string()))?;
            let field = |k: &str| {
                obj.get(k)
                    .ok_or_else(|| err(line, format!("missing field {k:?}")))
            };
            let ts = field("timestamp")?;
            let ms = ts
                .as_f64()
                .filter(|t| t.is_finite() && *t >= 0.0)
                .ok_or_else(|| {
                    err(
                        line,
                        format!("timestamp: expected a number of milliseconds >= 0, got {ts}"),
                    )
                })?;
            if ms < last_ms {
                return Err(err(
                    line,
                    format!("timestamp {ts} goes backwards (previous line has {last_ms})"),
                ));
            }
            last_ms = ms;
            let whole = |k: &str| -> Result<usize, Error> {
                let x = field(k)?;
                x.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .filter(|&n| n <= MAX_TOKENS)
                    .ok_or_else(|| {
                        err(
                            line,
                            format!("{k}: expected a whole number from 0 to {MAX_TOKENS}, got {x}"),
                        )
                    })
            };
            let input_len = whole("input_length")?;
            let output_len = whole("output_length")?;
            let ids_v = field("hash_ids")?;
            let ids_arr = ids_v.as_array().ok_or_else(|| {
                err(
                    line,
                    format!("hash_ids: expected an array of ids, got {ids_v}"),
                )
            })?;
            let mut ids = Vec::with_capacity(ids_arr.len());
            for x in ids_arr {
                ids.push(x.as_u64().ok_or_else(|| {
                    err(
                        line,
                        format!("hash_ids: expected whole numbers >= 0, got {x}"),
                    )
                })?);
            }
            let allowed = block_size.blocks_for(input_len);
            if ids.len() > allowed {
                return Err(err(
                    line,
                    format!(
                        "{} hash_ids for input_length {input_len}: at most {allowed} blocks of {block_size} tokens \
                         (are the trace's blocks {block_size} tokens?)",
                        ids.len()
                    ),
                ));
            }
            let mut parent = None;
            for &id in &ids {
                match parents.get(&id) {
                    Some(&(p, seen)) if p != parent => {
                        return Err(err(
                            line,
                            format!(
                                "hash id {id} follows {} here but {} on line {seen}: ids must be prefix-chained",
                                show(parent),
                                show(p)
                            ),
                        ));
                    }
                    Some(_) => {}
                    None => {
                        parents.insert(id, (parent, line));
                    }
                }
                parent = Some(id);
            }
            let origin = *first_ms.get_or_insert(ms);
            let full = block_size.full_blocks(input_len).min(ids.len());
            requests.push(TraceRequest {
                arrival_us: ((ms - origin) * 1000.0).round() as u64,
                input_len,
                output_len,
                blocks: ids[..full].iter().map(|&id| BlockHash::new(id)).collect(),
                partial: ids.get(full).map(|&id| BlockHash::new(id)),
            });
        }
        Ok(Trace {
            name: name.to_string(),
            block_size,
            requests,
        })
    }

    /// The name given when loading (the file path).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Tokens per block of the trace's ids.
    pub fn block_size(&self) -> BlockSize {
        self.block_size
    }

    /// The requests, in file order.
    pub fn requests(&self) -> &[TraceRequest] {
        &self.requests
    }

    /// Summary statistics, including the ideal hit rate.
    pub fn stats(&self) -> TraceStats {
        let r = &self.requests;
        // One unbounded cache in arrival order: a reference hits if the id was seen before.
        let (mut seen_full, mut seen_all) = (HashSet::new(), HashSet::new());
        let (mut refs_full, mut hits_full, mut refs_all, mut hits_all) = (0, 0, 0, 0);
        for req in r {
            refs_full += req.blocks.len();
            hits_full += req.blocks.iter().filter(|b| !seen_full.insert(**b)).count();
            for b in req.blocks.iter().chain(&req.partial) {
                refs_all += 1;
                hits_all += usize::from(!seen_all.insert(*b));
            }
        }
        let ratio = |a: usize, b: usize| if b > 0 { a as f64 / b as f64 } else { 0.0 };
        let mut inputs: Vec<usize> = r.iter().map(|x| x.input_len).collect();
        let mut outputs: Vec<usize> = r.iter().map(|x| x.output_len).collect();
        TraceStats {
            requests: r.len(),
            span_s: r.last().map_or(0.0, |x| x.arrival_us as f64 / 1e6),
            input: Lengths::of(&mut inputs),
            output: Lengths::of(&mut outputs),
            unique_blocks: seen_all.len(),
            ideal_hit_rate_full_blocks: ratio(hits_full, refs_full),
            ideal_hit_rate_all_ids: ratio(hits_all, refs_all),
        }
    }
}

impl TraceStats {
    /// The statistics as `kvsim trace-stats` prints them.
    pub fn to_text(&self, name: &str) -> String {
        format!(
            "  Trace: {name}\n  Requests: {} over {:.1} s ({:.2} req/s)\n  \
             Input tokens: mean {:.0}, p50 {}, p99 {}\n  Output tokens: mean {:.0}, p50 {}, p99 {}\n  \
             Unique blocks: {}\n  \
             Ideal hit rate (one unbounded cache, arrival order): {:.1}% of full blocks ({:.1}% of all ids)\n",
            self.requests,
            self.span_s,
            if self.span_s > 0.0 { self.requests as f64 / self.span_s } else { 0.0 },
            self.input.mean,
            self.input.p50,
            self.input.p99,
            self.output.mean,
            self.output.p50,
            self.output.p99,
            self.unique_blocks,
            self.ideal_hit_rate_full_blocks * 100.0,
            self.ideal_hit_rate_all_ids * 100.0,
        )
    }
}

fn show(id: Option<u64>) -> String {
    id.map_or_else(
        || "nothing (first block)".to_string(),
        |p| format!("id {p}"),
    )
}

/// Mean, median and 99th percentile of a length (nearest rank).
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
#[non_exhaustive]
pub struct Lengths {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: usize,
    /// 99th percentile.
    pub p99: usize,
}

impl Lengths {
    fn of(v: &mut [usize]) -> Self {
        if v.is_empty() {
            return Lengths::default();
        }
        v.sort_unstable();
        let at = |q: f64| {
            let rank = nearest_rank(q, v.len() as u64) as usize;
            v.get(rank - 1).copied().unwrap_or_default()
        };
        Lengths {
            // Summed as f64: no length bound is needed for the mean not to overflow.
            mean: v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64,
            p50: at(0.5),
            p99: at(0.99),
        }
    }
}

/// What `kvsim trace-stats` prints.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[non_exhaustive]
pub struct TraceStats {
    /// Requests.
    pub requests: usize,
    /// From the first to the last arrival, seconds.
    pub span_s: f64,
    /// Prompt lengths, tokens.
    pub input: Lengths,
    /// Output lengths, tokens.
    pub output: Lengths,
    /// Distinct block ids.
    pub unique_blocks: usize,
    /// Block reuse with one unbounded cache in arrival order, over full blocks (what a replay
    /// can reach: a partial last block is not cacheable).
    pub ideal_hit_rate_full_blocks: f64,
    /// The same over every id, partial last blocks included.
    pub ideal_hit_rate_all_ids: f64,
}
