//! Mooncake-format request traces: loading, validation and statistics.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use kvblock::{BlockHash, BlockSize};
use serde_json::Value;

use crate::error::{Error, TraceError};
use crate::fastline::fast_line;
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
    /// The conversation it belongs to (`session_id`), numbered from 0 in order of first
    /// appearance; its turns are the session's lines in file order.
    pub session: Option<usize>,
    /// Think time before it is sent after the previous turn of its session finished, µs
    /// (`think_time_ms`; 0 when absent).
    pub think_us: u64,
}

/// A request trace in the Mooncake JSONL format: one JSON object per line with `timestamp`
/// (ms), `input_length`, `output_length` and `hash_ids` (prefix-chained ids of fixed-size token
/// blocks). Unknown fields are ignored; blank lines are skipped.
///
/// Two optional fields make a multi-turn (closed-loop) trace: `session_id` (a string or a
/// whole number, compared as text) groups lines into conversations whose turns are their
/// lines in file order, and `think_time_ms` (a number >= 0) is the pause between the end of a
/// turn and the sending of the next. A later turn is sent at the later of its own timestamp
/// and the end of its session's previous turn plus its think time; a line without
/// `session_id` is a one-turn session of its own.
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
        use std::io::{Read, Seek, SeekFrom};
        let file = path.display().to_string();
        let cannot = |e: std::io::Error| TraceError {
            file: file.clone(),
            line: 0,
            what: format!("cannot read: {e}"),
        };
        let mut f = std::fs::File::open(path).map_err(cannot)?;
        // A regular file is read in pieces through one reused buffer: its text is never held
        // whole. On any failure (a non-UTF-8 file, a bad line) it is read again from the start
        // and worded by the whole-text path, exactly as it always was. A pipe or FIFO cannot be
        // read twice: it is read whole, once.
        if f.metadata().is_ok_and(|m| m.is_file()) {
            if let Some(trace) = Self::stream(&file, &mut f, block_size) {
                return Ok(trace);
            }
            f.seek(SeekFrom::Start(0)).map_err(cannot)?;
        }
        let mut text = String::new();
        f.read_to_string(&mut text).map_err(cannot)?;
        Self::parse(&file, &text, block_size)
    }

    /// Reads and checks the file `f` (at its start) line by line, splitting lines as
    /// [`str::lines`] does; `None` on any failure.
    fn stream(name: &str, f: &mut std::fs::File, block_size: BlockSize) -> Option<Self> {
        use std::io::Read;
        let mut parser = Parser::new(block_size);
        let mut buf = vec![0u8; 1 << 16];
        // `buf[..filled]` holds what is read and not yet parsed: the start of a line.
        let mut filled = 0;
        loop {
            if filled == buf.len() {
                // A line longer than the buffer.
                buf.resize(buf.len() * 2, 0);
            }
            let n = match f.read(&mut buf[filled..]) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(_) => return None,
            };
            let end = filled + n;
            // The complete lines read so far, checked as UTF-8 at once and split as `lines`
            // splits (a newline, and a carriage return before it).
            let start = match buf[filled..end].iter().rposition(|&c| c == b'\n') {
                Some(i) => {
                    let text = std::str::from_utf8(&buf[..filled + i + 1]).ok()?;
                    for piece in text.split_inclusive('\n') {
                        let raw = piece.strip_suffix('\n').unwrap_or(piece);
                        parser.line(raw.strip_suffix('\r').unwrap_or(raw)).ok()?;
                    }
                    filled + i + 1
                }
                None => 0,
            };
            if n == 0 {
                // The end: a last line without a newline (never a carriage return stripped).
                if start < end {
                    parser
                        .line(std::str::from_utf8(&buf[start..end]).ok()?)
                        .ok()?;
                }
                return Some(parser.finish(name));
            }
            buf.copy_within(start..end, 0);
            filled = end - start;
        }
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
        let mut parser = Parser::new(block_size);
        for (i, raw) in text.lines().enumerate() {
            let line = i + 1;
            match parser.line(raw) {
                Ok(()) => {}
                Err(LineError::What(what)) => return Err(err(line, what)),
                Err(LineError::Chain { id, here, there }) => {
                    // The line the id was first seen on: the first line before this one that
                    // names it (every one of them was read without error).
                    let mut ids = Vec::new();
                    let seen = text
                        .lines()
                        .take(line)
                        .position(|raw| {
                            line_ids(raw, &mut ids);
                            ids.contains(&id)
                        })
                        .map_or(0, |j| j + 1);
                    return Err(err(
                        line,
                        format!(
                            "hash id {id} follows {} here but {} on line {seen}: ids must be prefix-chained",
                            show(here),
                            show(there)
                        ),
                    ));
                }
            }
        }
        Ok(parser.finish(name))
    }

    /// A trace of measured requests (spans, request records), which carry lengths and times
    /// but no tokens: every prompt's first `shared_prefix_tokens` tokens are the same, the rest
    /// unique to it, in blocks of `block_size`. Arrival times are the requests' own; failed
    /// requests are left out (the engine did not serve them as measured).
    ///
    /// ```
    /// use kvblock::BlockSize;
    /// let reqs = [
    ///     kvsim::MeasuredRequest::new(0, 40, 8, 0, 1_000, 9_000),
    ///     kvsim::MeasuredRequest::new(5_000, 40, 8, 0, 6_000, 14_000),
    /// ];
    /// let t = kvsim::Trace::from_measured("spans", &reqs, 16, BlockSize::new(16)?);
    /// let (a, b) = (&t.requests()[0], &t.requests()[1]);
    /// assert_eq!(a.blocks[0], b.blocks[0]); // the shared 16 tokens
    /// assert_ne!(a.blocks[1], b.blocks[1]); // the rest is each prompt's own
    /// assert_eq!(b.arrival_us, 5_000);
    /// # Ok::<(), kvblock::Error>(())
    /// ```
    pub fn from_measured(
        name: &str,
        requests: &[crate::records::MeasuredRequest],
        shared_prefix_tokens: usize,
        block_size: BlockSize,
    ) -> Self {
        let bs = block_size.get();
        // Shared blocks are ids 1..; each prompt's own blocks count on from 2^40 (no prompt
        // has 2^40 blocks, so the two ranges never meet).
        let mut own = 1u64 << 40;
        let requests = requests
            .iter()
            .filter(|r| !r.failed)
            .map(|r| {
                let full = r.input_len / bs;
                let shared = shared_prefix_tokens.min(r.input_len) / bs;
                let blocks = (0..full)
                    .map(|j| {
                        if j < shared {
                            BlockHash::new(j as u64 + 1)
                        } else {
                            own += 1;
                            BlockHash::new(own)
                        }
                    })
                    .collect();
                TraceRequest {
                    arrival_us: r.arrival_us,
                    input_len: r.input_len,
                    output_len: r.output_len,
                    blocks,
                    partial: None,
                    session: None,
                    think_us: 0,
                }
            })
            .collect();
        Trace {
            name: name.to_string(),
            block_size,
            requests,
        }
    }

    /// Whether any line carries a `session_id` (the trace is replayed closed-loop).
    pub fn has_sessions(&self) -> bool {
        self.requests.iter().any(|r| r.session.is_some())
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

/// What is wrong with a line: the words, or an id that follows `here` on it but `there` on
/// the line that first named it (which the caller finds).
enum LineError {
    What(String),
    Chain {
        id: u64,
        here: Option<u64>,
        there: Option<u64>,
    },
}

/// The state of reading a trace line by line.
struct Parser {
    block_size: BlockSize,
    requests: Vec<TraceRequest>,
    first_ms: Option<f64>,
    last_ms: f64,
    /// id -> parent id, to check that ids are prefix-chained.
    parents: Parents,
    ids: Vec<u64>,
    sessions: HashMap<String, usize>,
}

impl Parser {
    fn new(block_size: BlockSize) -> Self {
        Parser {
            block_size,
            requests: Vec::new(),
            first_ms: None,
            last_ms: f64::NEG_INFINITY,
            parents: Parents::default(),
            ids: Vec::new(),
            sessions: HashMap::new(),
        }
    }

    /// Reads the next line, `raw` without its line ending.
    fn line(&mut self, raw: &str) -> Result<(), LineError> {
        if raw.trim().is_empty() {
            return Ok(());
        }
        let (block_size, last_ms) = (self.block_size, self.last_ms);
        let ids = &mut self.ids;
        // The common shape is read directly; anything else, or anything wrong, goes through
        // the general JSON path, which also words the errors.
        let fast = fast_line(raw, ids).filter(|&(ms, input, output)| {
            ms >= last_ms && input <= MAX_TOKENS && output <= MAX_TOKENS
        });
        let mut extra = Extra::default();
        let (ms, input_len, output_len) = match fast {
            Some(x) => x,
            None => general_line(raw, last_ms, ids, &mut extra).map_err(LineError::What)?,
        };
        self.last_ms = ms;
        let allowed = block_size.blocks_for(input_len);
        if ids.len() > allowed {
            return Err(LineError::What(format!(
                "{} hash_ids for input_length {input_len}: at most {allowed} blocks of {block_size} tokens \
                 (are the trace's blocks {block_size} tokens?)",
                ids.len()
            )));
        }
        let mut parent = None;
        for &id in ids.iter() {
            match self.parents.get(id) {
                Some(p) if p != parent => {
                    return Err(LineError::Chain {
                        id,
                        here: parent,
                        there: p,
                    });
                }
                Some(_) => {}
                None => self.parents.insert(id, parent),
            }
            parent = Some(id);
        }
        let origin = *self.first_ms.get_or_insert(ms);
        let full = block_size.full_blocks(input_len).min(ids.len());
        let sessions = &mut self.sessions;
        self.requests.push(TraceRequest {
            arrival_us: ((ms - origin) * 1000.0).round() as u64,
            input_len,
            output_len,
            blocks: ids[..full].iter().map(|&id| BlockHash::new(id)).collect(),
            partial: ids.get(full).map(|&id| BlockHash::new(id)),
            session: extra.session.take().map(|k| {
                let next = sessions.len();
                *sessions.entry(k).or_insert(next)
            }),
            think_us: extra.think_ms.map_or(0, |t| (t * 1000.0).round() as u64),
        });
        Ok(())
    }

    fn finish(self, name: &str) -> Trace {
        Trace {
            name: name.to_string(),
            block_size: self.block_size,
            requests: self.requests,
        }
    }
}

/// The ids of a line that reads without error.
fn line_ids(raw: &str, ids: &mut Vec<u64>) {
    ids.clear();
    if !raw.trim().is_empty() && fast_line(raw, ids).is_none() {
        let _ = general_line(raw, f64::NEG_INFINITY, ids, &mut Extra::default());
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

/// Block id -> parent id: a table indexed by id while ids are about as dense as the Mooncake
/// traces' (numbered from 0), a hash map beyond. Eight bytes an id, in pages of `PAGE` ids
/// allocated as ids reach them (never copied, never zeroed ahead): the line an id was first
/// seen on is only needed for an error, and found then by reading the text again.
#[derive(Debug, Default)]
struct Parents {
    /// Per id: 0 = unseen, 1 = first block, p + 2 = follows id p.
    dense: Vec<Box<[u64]>>,
    sparse: HashMap<u64, Option<u64>, IdHash>,
    count: usize,
}

/// Ids per page of [`Parents`]' table.
const PAGE: usize = 1 << 12;

impl Parents {
    fn get(&self, id: u64) -> Option<Option<u64>> {
        let slot = usize::try_from(id)
            .ok()
            .and_then(|i| self.dense.get(i / PAGE).map(|page| page[i % PAGE]));
        match slot {
            Some(p) if p != 0 => Some((p > 1).then(|| p - 2)),
            // Not in the table: the map may hold it (stored before the table reached it).
            _ if self.sparse.is_empty() => None,
            _ => self.sparse.get(&id).copied(),
        }
    }

    /// Records an id `get` does not know.
    fn insert(&mut self, id: u64, parent: Option<u64>) {
        self.count += 1;
        let code = match parent {
            None => 1,
            Some(p) => match p.checked_add(2) {
                Some(c) => c,
                None => {
                    self.sparse.insert(id, parent);
                    return;
                }
            },
        };
        let reached = (self.dense.len() * PAGE) as u64;
        if id >= reached && id < (self.count as u64).saturating_mul(8).max(1 << 16) {
            let pages = id as usize / PAGE + 1;
            self.dense
                .resize_with(pages, || vec![0; PAGE].into_boxed_slice());
        }
        let slot = usize::try_from(id)
            .ok()
            .and_then(|i| self.dense.get_mut(i / PAGE).map(|page| &mut page[i % PAGE]));
        match slot {
            Some(slot) => *slot = code,
            None => {
                self.sparse.insert(id, parent);
            }
        }
    }
}

/// Hashes a trace's block ids (deterministic; ids are spread by a multiply).
#[derive(Debug, Clone, Copy, Default)]
struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(self.0 ^ u64::from(b));
        }
    }
    fn write_u64(&mut self, x: u64) {
        let m = u128::from(x ^ self.0) * 0x9E37_79B9_7F4A_7C15;
        self.0 = (m as u64) ^ ((m >> 64) as u64);
    }
}

type IdHash = std::hash::BuildHasherDefault<IdHasher>;

/// Reads any line through JSON values: (timestamp ms, input length, output length) and the
/// ids in `ids`, or what is wrong with the line.
/// The optional fields of a multi-turn trace line.
#[derive(Debug, Default)]
struct Extra {
    session: Option<String>,
    think_ms: Option<f64>,
}

fn general_line(
    raw: &str,
    last_ms: f64,
    ids: &mut Vec<u64>,
    extra: &mut Extra,
) -> Result<(f64, usize, usize), String> {
    let v: Value = serde_json::from_str(raw).map_err(|e| format!("bad JSON: {e}"))?;
    let obj = v
        .as_object()
        .ok_or_else(|| "expected a JSON object".to_string())?;
    let field = |k: &str| obj.get(k).ok_or_else(|| format!("missing field {k:?}"));
    let ts = field("timestamp")?;
    let ms = ts
        .as_f64()
        .filter(|t| t.is_finite() && *t >= 0.0)
        .ok_or_else(|| format!("timestamp: expected a number of milliseconds >= 0, got {ts}"))?;
    if ms < last_ms {
        return Err(format!(
            "timestamp {ts} goes backwards (previous line has {last_ms})"
        ));
    }
    let whole = |k: &str| -> Result<usize, String> {
        let x = field(k)?;
        x.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .filter(|&n| n <= MAX_TOKENS)
            .ok_or_else(|| format!("{k}: expected a whole number from 0 to {MAX_TOKENS}, got {x}"))
    };
    let input_len = whole("input_length")?;
    let output_len = whole("output_length")?;
    let ids_v = field("hash_ids")?;
    let ids_arr = ids_v
        .as_array()
        .ok_or_else(|| format!("hash_ids: expected an array of ids, got {ids_v}"))?;
    ids.clear();
    for x in ids_arr {
        ids.push(
            x.as_u64()
                .ok_or_else(|| format!("hash_ids: expected whole numbers >= 0, got {x}"))?,
        );
    }
    extra.session = match obj.get("session_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(k)) => Some(k.clone()),
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => Some(n.to_string()),
        Some(x) => {
            return Err(format!(
                "session_id: expected a string or a whole number, got {x}"
            ))
        }
    };
    extra.think_ms = match obj.get("think_time_ms") {
        None | Some(Value::Null) => None,
        Some(x) => Some(
            x.as_f64()
                .filter(|t| t.is_finite() && (0.0..=1e12).contains(t))
                .ok_or_else(|| {
                    format!("think_time_ms: expected a number of milliseconds >= 0, got {x}")
                })?,
        ),
    };
    Ok((ms, input_len, output_len))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fastline::digits8;

    /// Wherever the direct reader accepts a line, it reads what the JSON path reads.
    #[test]
    fn fast_lines_read_like_json() {
        let lines = [
            r#"{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}"#,
            r#"{"hash_ids":[],"output_length":1,"input_length":0,"timestamp":12}"#,
            " \t{ \"timestamp\" : 7 , \"input_length\" : 10 , \"output_length\" : 2 , \"hash_ids\" : [ 5 ] } \r",
            r#"{"timestamp": 1.5, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
            r#"{"timestamp": 1e3, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
            r#"{"timestamp": 01, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
            r#"{"timestamp": -1, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
            r#"{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [], "x": 1}"#,
            r#"{"timestamp": 3, "timestamp": 4, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
            r#"{"timestamp": 3, "input_length": 1, "output_length": 1}"#,
            r#"{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [1,]}"#,
            r#"{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [1 2]}"#,
            r#"{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [1]} x"#,
            r#"{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [1]}}"#,
            r#"{"timestamp": 3, "input_length": 1, "output_length": 1, "hash_ids": [1.0]}"#,
            r#"{"timestamp": 123456789012345678, "input_length": 1, "output_length": 1, "hash_ids": [18446744073709551615]}"#,
            r#"{"timestamp": 9, "input_length": 1, "output_length": 1, "hash_ids": [0, 00]}"#,
            r#"{"time\u0073tamp": 9, "input_length": 1, "output_length": 1, "hash_ids": []}"#,
            r#"[1, 2]"#,
            r#"{"timestamp": 3, "input_length": 16777217, "output_length": 1, "hash_ids": []}"#,
        ];
        let mut accepted = 0;
        for raw in lines {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            // `parse` also sends lengths beyond MAX_TOKENS to the JSON path.
            let fast = fast_line(raw, &mut a).filter(|x| x.1 <= MAX_TOKENS && x.2 <= MAX_TOKENS);
            let general = general_line(raw, f64::NEG_INFINITY, &mut b, &mut Extra::default());
            if let Some(x) = fast {
                accepted += 1;
                assert_eq!(general, Ok(x), "{raw}");
                assert_eq!(a, b, "{raw}");
            }
        }
        assert_eq!(accepted, 3);
    }

    /// A file read piece by piece loads exactly as its text parses, errors included: line
    /// endings, blank lines, a last line without a newline, a line longer than the read
    /// buffer, a broken id chain, and bytes that are not UTF-8 after a bad line.
    #[test]
    fn load_reads_like_parse() {
        let line = |ts: u64, input: usize, ids: &[u64]| {
            format!(
                r#"{{"timestamp": {ts}, "input_length": {input}, "output_length": 3, "hash_ids": {ids:?}}}"#
            )
        };
        let long: Vec<u64> = (100..30_000).collect();
        let texts: Vec<Vec<u8>> = vec![
            format!(
                "{}\n{}\n",
                line(0, 1024, &[0, 1]),
                line(5, 1500, &[0, 1, 2])
            )
            .into(),
            format!("{}\r\n\r\n{}\r", line(0, 1024, &[0, 1]), line(5, 600, &[0])).into(),
            format!("{}\n\n\n{}", line(0, 1024, &[7]), line(1, 1 << 24, &long)).into(),
            format!("{}\n{}\n", line(0, 1024, &[1, 2]), line(1, 1024, &[3, 2])).into(),
            format!("{}\n{}\n", line(0, 1024, &[4, 4]), line(1, 1024, &[3])).into(),
            format!("{}\n{}\n", line(0, 1024, &[1]), r#"{"timestamp": 1,}"#).into(),
            [line(0, 1024, &[1]).as_bytes(), b"\n{\"x\n\xff\n"].concat(),
            Vec::new(),
        ];
        let bs = BlockSize::new(512).expect("non-zero");
        let dir = std::env::temp_dir();
        for (i, bytes) in texts.iter().enumerate() {
            let path = dir.join(format!("kvsim-load-{}-{i}.jsonl", std::process::id()));
            std::fs::write(&path, bytes).expect("writes");
            let name = path.display().to_string();
            let want = match std::str::from_utf8(bytes) {
                Ok(text) => Trace::parse(&name, text, bs).map_err(|e| e.to_string()),
                Err(_) => Err(format!(
                    "{name}: cannot read: stream did not contain valid UTF-8"
                )),
            };
            let got = Trace::load(&path, bs).map_err(|e| e.to_string());
            std::fs::remove_file(&path).expect("removes");
            assert_eq!(got, want, "text {i}");
            // The line an id was first seen on, found again when its chain breaks.
            let chain = match i {
                3 => Some("2: hash id 2 follows id 3 here but id 1 on line 1"),
                4 => Some("1: hash id 4 follows id 4 here but nothing (first block) on line 1"),
                _ => None,
            };
            if let Some(c) = chain {
                let msg = format!("{name}:{c}: ids must be prefix-chained");
                assert_eq!(got, Err(msg), "text {i}");
            }
        }
    }

    /// A pipe is read once, whole: a bad line is worded as from a file, and a good pipe gives
    /// the trace a file gives (a second open of a pipe would read only what is left in it).
    #[cfg(target_os = "linux")]
    #[test]
    fn load_reads_a_pipe_like_parse() {
        use std::os::fd::AsRawFd;
        let good =
            r#"{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1]}"#;
        // More than one 64 KB read after the bad first line.
        let tail = format!("{good}\n").repeat(2_000);
        let bs = BlockSize::new(512).expect("non-zero");
        for text in [format!("{{\"timestamp\": 1,}}\n{tail}"), tail.clone()] {
            let path = std::env::temp_dir().join(format!(
                "kvsim-pipe-{}-{}.jsonl",
                std::process::id(),
                text.len()
            ));
            std::fs::write(&path, &text).expect("writes");
            let mut cat = std::process::Command::new("cat")
                .arg(&path)
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("cat starts");
            let out = cat.stdout.take().expect("piped");
            let pipe = format!("/proc/self/fd/{}", out.as_raw_fd());
            let got = Trace::load(Path::new(&pipe), bs).map_err(|e| e.to_string());
            drop(out);
            let _ = cat.wait();
            std::fs::remove_file(&path).expect("removes");
            let want = Trace::parse(&pipe, &text, bs).map_err(|e| e.to_string());
            assert_eq!(got, want);
        }
    }

    /// Eight bytes at once read the digits a byte at a time reads, whatever follows them.
    #[test]
    fn digits8_reads_like_a_loop() {
        let alphabet = b"0123456789012345678901234567890123456789 ,]}.eE-x/:\xff\x00";
        let mut rng = crate::rng::SimRng::new(0x9E37_79B9_7F4A_7C15, 0);
        for _ in 0..200_000 {
            let mut bytes = [0u8; 8];
            for b in &mut bytes {
                *b = alphabet[rng.below(alphabet.len() as u64) as usize];
            }
            let len = bytes.iter().take_while(|c| c.is_ascii_digit()).count();
            let value = bytes[..len]
                .iter()
                .fold(0u64, |n, &c| n * 10 + u64::from(c - b'0'));
            let want = (len < 8).then_some((value, len));
            assert_eq!(digits8(bytes), want, "{bytes:?}");
        }
    }

    /// The id table answers like a plain map, dense, sparse and huge ids mixed.
    #[test]
    fn parents_table_is_a_map() {
        let mut t = Parents::default();
        let mut model: HashMap<u64, Option<u64>> = HashMap::new();
        let mut rng = crate::rng::SimRng::new(7, 0);
        for line in 0..20_000usize {
            let x = rng.next_u64();
            let id = match x >> 62 {
                0 => x >> 48,
                1 => (x >> 8) % 300_000,
                2 => u64::MAX - (x >> 60),
                _ => line as u64,
            };
            let parent = match (x >> 20) % 4 {
                0 => None,
                1 => Some(u64::MAX - 1),
                _ => Some(x >> 40),
            };
            assert_eq!(t.get(id), model.get(&id).copied(), "{id}");
            if t.get(id).is_none() {
                t.insert(id, parent);
                model.insert(id, parent);
            }
        }
        for (&id, &v) in &model {
            assert_eq!(t.get(id), Some(v));
        }
    }
}
