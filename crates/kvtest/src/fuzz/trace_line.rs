//! `trace_line`: Mooncake trace text into `kvsim::Trace::parse` with several block sizes: an
//! error naming a line of the text, or requests, never a panic. The first byte picks the block
//! size and the mode: arbitrary bytes as text (and the same text flattened to a single line), or
//! (high bit set) well-formed lines built from structured input, with extreme numbers (`u64::MAX`,
//! negatives, floats, exponents, wrong types) where the fields go. When it parses: one request
//! per non-blank line, every request has at most `input_len / block_size` full blocks (and a
//! partial id only when the length has a partial block), arrivals start at 0 and never
//! decrease, ids stay prefix-chained, and `stats()` / `to_text()` never panic and give sane
//! numbers.

use std::collections::{BTreeSet, HashMap};

use arbitrary::{Arbitrary, Unstructured};
use kvblock::{BlockHash, BlockSize};
use kvsim::Trace;

const BLOCK_SIZES: [usize; 8] = [1, 2, 3, 16, 512, 4096, 1 << 20, u32::MAX as usize];

fn check_text(text: &str, bs: BlockSize) {
    let name = "fuzz.jsonl";
    let lines = text.lines().count();
    match Trace::parse(name, text, bs) {
        Err(kvsim::Error::Trace(e)) => {
            assert_eq!(e.file, name);
            assert!(
                e.line >= 1 && e.line <= lines,
                "{e}: line out of 1..={lines}"
            );
            assert!(!e.to_string().is_empty());
        }
        Err(e) => panic!("parsing text gave a non-trace error: {e}"),
        Ok(trace) => {
            assert_eq!((trace.name(), trace.block_size()), (name, bs));
            let reqs = trace.requests();
            let non_blank = text.lines().filter(|l| !l.trim().is_empty()).count();
            assert_eq!(reqs.len(), non_blank, "one request per non-blank line");
            let b = bs.get();
            let mut parents: HashMap<BlockHash, Option<BlockHash>> = HashMap::new();
            let mut ids = BTreeSet::new();
            let mut total_ids = 0;
            for (i, r) in reqs.iter().enumerate() {
                assert!(
                    r.blocks.len() <= r.input_len / b,
                    "request {i}: {} blocks for {} tokens of block size {b}",
                    r.blocks.len(),
                    r.input_len
                );
                if r.partial.is_some() {
                    assert_eq!(
                        r.blocks.len(),
                        r.input_len / b,
                        "request {i}: partial id early"
                    );
                    assert_ne!(
                        r.input_len % b,
                        0,
                        "request {i}: partial id, no partial block"
                    );
                }
                if i == 0 {
                    assert_eq!(r.arrival_us, 0, "the first request arrives at 0");
                } else {
                    assert!(
                        r.arrival_us >= reqs[i - 1].arrival_us,
                        "request {i} goes back"
                    );
                }
                let mut parent = None;
                for &id in r.blocks.iter().chain(&r.partial) {
                    let p = *parents.entry(id).or_insert(parent);
                    assert_eq!(p, parent, "request {i}: {id} is not prefix-chained");
                    parent = Some(id);
                    ids.insert(id);
                    total_ids += 1;
                }
            }
            let s = trace.stats();
            assert_eq!(s.requests, reqs.len());
            assert_eq!(s.unique_blocks, ids.len());
            assert!(s.unique_blocks <= total_ids);
            for rate in [s.ideal_hit_rate_full_blocks, s.ideal_hit_rate_all_ids] {
                assert!((0.0..=1.0).contains(&rate), "hit rate {rate}");
            }
            let last = reqs.last().map_or(0, |r| r.arrival_us);
            assert_eq!(s.span_s, last as f64 / 1e6);
            for (l, v) in [
                (
                    s.input,
                    reqs.iter().map(|r| r.input_len).collect::<Vec<_>>(),
                ),
                (s.output, reqs.iter().map(|r| r.output_len).collect()),
            ] {
                let (lo, hi) = (v.iter().min(), v.iter().max());
                if let (Some(&lo), Some(&hi)) = (lo, hi) {
                    assert!(lo <= l.p50 && l.p50 <= l.p99 && l.p99 <= hi, "{l:?}");
                    assert!(
                        l.mean >= lo as f64 * (1.0 - 1e-12) && l.mean <= hi as f64 * (1.0 + 1e-12),
                        "{l:?}"
                    );
                }
            }
            assert!(!s.to_text(trace.name()).is_empty());
        }
    }
}

/// A JSON value where a number is expected.
#[derive(Debug, Arbitrary)]
pub enum Num {
    /// A small integer.
    Small(u8),
    /// Any `u64`.
    Any(u64),
    /// `u64::MAX`.
    Max,
    /// Around 2^24 (the token limit).
    Tokens(u8),
    /// A negative integer (down to below `i64::MIN`).
    Negative(i64),
    /// A float (`1e400` when not finite).
    Float(f64),
    /// `1e<e>`.
    Exponent(i8),
    /// A string.
    Text,
    /// `null`.
    Null,
}

impl Num {
    fn render(&self) -> String {
        match self {
            Num::Small(x) => x.to_string(),
            Num::Any(x) => x.to_string(),
            Num::Max => u64::MAX.to_string(),
            // Around the 2^24-token limit.
            Num::Tokens(k) => ((1u64 << 24) + u64::from(*k) - 128).to_string(),
            Num::Negative(x) => (-(x.unsigned_abs() as i128) - 1).to_string(),
            Num::Float(x) if x.is_finite() => format!("{x:?}"),
            Num::Float(_) => "1e400".to_string(),
            Num::Exponent(e) => format!("1e{e}"),
            Num::Text => "\"7\"".to_string(),
            Num::Null => "null".to_string(),
        }
    }
}

/// One line of a trace, well-formed JSON with any values.
#[derive(Debug, Arbitrary)]
pub struct Line {
    /// `timestamp`.
    pub timestamp: Num,
    /// `input_length`.
    pub input_length: Num,
    /// `output_length`.
    pub output_length: Num,
    /// Mostly small ids, so that lines share prefixes (and sometimes break the chain).
    pub hash_ids: Vec<u8>,
    /// One more id of any value, appended.
    pub odd_id: Option<Num>,
    /// Bit k drops field k (rarely wanted: only when all low bits are set).
    pub omit: u8,
    /// A blank line (spaces) after this one.
    pub blank_after: bool,
}

impl Line {
    fn render(&self) -> String {
        let mut ids: Vec<String> = self.hash_ids.iter().map(|&b| (b % 8).to_string()).collect();
        if let Some(n) = &self.odd_id {
            ids.push(n.render());
        }
        let fields = [
            ("timestamp", self.timestamp.render()),
            ("input_length", self.input_length.render()),
            ("output_length", self.output_length.render()),
            ("hash_ids", format!("[{}]", ids.join(", "))),
        ];
        let drop = if self.omit & 0xf0 == 0xf0 {
            self.omit & 0x0f
        } else {
            0
        };
        let body: Vec<String> = fields
            .iter()
            .enumerate()
            .filter(|(k, _)| drop & (1 << k) == 0)
            .map(|(_, (k, v))| format!("\"{k}\": {v}"))
            .collect();
        let mut line = format!("{{{}}}\n", body.join(", "));
        if self.blank_after {
            line.push_str(" \n");
        }
        line
    }
}

/// What the fuzz target does with its bytes: the first byte picks the block size and the mode.
pub fn run(data: &[u8]) {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let bs = BlockSize::new(BLOCK_SIZES[usize::from(first) % BLOCK_SIZES.len()]).expect("valid");
    if first & 0x80 != 0 {
        let Ok(lines) = Vec::<Line>::arbitrary_take_rest(Unstructured::new(rest)) else {
            return;
        };
        let text: String = lines.iter().map(Line::render).collect();
        check_text(&text, bs);
        return;
    }
    let text = String::from_utf8_lossy(rest);
    check_text(&text, bs);
    let line: String = text
        .chars()
        .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
        .collect();
    if line != *text {
        check_text(&line, bs);
    }
}
