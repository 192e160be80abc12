//! The engine settings a vLLM startup log states, so that a simulated engine can be configured
//! as the real one was (`kvsim --vllm-log`).

use std::path::Path;

use serde::Serialize;

use kvblock::BlockSize;

use crate::config::SimConfig;
use crate::engine::{KvAllocation, Scheduler};
use crate::error::{Error, TraceError};

/// What a vLLM log says about the engine that served: the last server start in the file (a log
/// may hold several). A field the log does not state is `None`.
///
/// ```
/// let log = "\
/// INFO vllm.entrypoints.openai.api_server: vLLM API server version 0.11.0
/// INFO vllm.entrypoints.utils: non-default args: {'model': 'm', 'max_num_batched_tokens': 4096, 'max_num_seqs': 256}
/// INFO vllm.v1.core.kv_cache_utils: GPU KV cache size: 40,592 tokens
/// INFO vllm.v1.metrics.loggers: Engine 000: vllm cache_config_info with initialization after num_gpu_blocks is: 2537
/// ";
/// let s = kvsim::VllmLog::parse("vllm.log", log)?;
/// assert_eq!((s.block_size, s.num_gpu_blocks, s.max_num_batched_tokens), (Some(16), Some(2537), Some(4096)));
/// # Ok::<(), kvsim::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct VllmLog {
    /// The vLLM version of the last start (`vLLM API server version X`).
    pub version: Option<String>,
    /// Tokens per KV block: `block_size` among the non-default arguments, or the KV cache size
    /// in tokens over `num_gpu_blocks`.
    pub block_size: Option<usize>,
    /// KV blocks on the GPU (`num_gpu_blocks is: N`).
    pub num_gpu_blocks: Option<usize>,
    /// KV cache size in tokens (`GPU KV cache size: N tokens`).
    pub kv_cache_tokens: Option<usize>,
    /// The step's token budget (`max_num_batched_tokens`).
    pub max_num_batched_tokens: Option<usize>,
    /// Running requests at most (`max_num_seqs`).
    pub max_num_seqs: Option<usize>,
    /// Automatic prefix caching (`enable_prefix_caching=`).
    pub prefix_caching: Option<bool>,
    /// Chunked prefill (`chunked_prefill_enabled=` or `Chunked prefill is enabled`).
    pub chunked_prefill: Option<bool>,
}

fn bad(file: &str, line: usize, what: impl Into<String>) -> Error {
    Error::EngineLog(TraceError {
        file: file.to_string(),
        line,
        what: what.into(),
    })
}

/// The whole number after `key` in `line` (digits with `,` or `_` separators), if any.
fn number_after(line: &str, key: &str) -> Option<Result<usize, String>> {
    let at = line.find(key)? + key.len();
    let digits: String = line[at..]
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == ',' || *c == '_')
        .filter(char::is_ascii_digit)
        .collect();
    Some(digits.parse().map_err(|_| {
        format!(
            "expected a whole number after {:?}, found {:?}",
            key.trim(),
            line[at..].chars().take(20).collect::<String>()
        )
    }))
}

/// `True`/`False` after `key`, if any.
fn bool_after(line: &str, key: &str) -> Option<bool> {
    let rest = &line[line.find(key)? + key.len()..];
    let rest = rest.trim_start();
    if rest.starts_with("True") {
        Some(true)
    } else if rest.starts_with("False") {
        Some(false)
    } else {
        None
    }
}

impl VllmLog {
    /// Reads a log file; see [`parse`](Self::parse).
    pub fn load(path: &Path) -> Result<Self, Error> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| bad(&name, 0, format!("cannot read: {e}")))?;
        // Logs carry colour codes and progress bars; a stray invalid byte is not a reason to
        // refuse the settings around it.
        Self::parse(&name, &String::from_utf8_lossy(&bytes))
    }

    /// Reads the settings of the last server start in `text`. A log without a KV cache size
    /// (`GPU KV cache size` or `num_gpu_blocks`) is an [`Error::EngineLog`]: the simulated
    /// engine's memory could not be set. `name` is used in errors.
    pub fn parse(name: &str, text: &str) -> Result<Self, Error> {
        let mut s = VllmLog::default();
        let mut explicit_block = None;
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            let num = |key: &str| {
                number_after(line, key)
                    .transpose()
                    .map_err(|w| bad(name, n, w))
            };
            if let Some(at) = line.find("vLLM API server version") {
                // A new start: what an earlier one said no longer holds.
                s = VllmLog {
                    version: line[at + "vLLM API server version".len()..]
                        .split_whitespace()
                        .next()
                        .map(str::to_string),
                    ..VllmLog::default()
                };
                explicit_block = None;
            }
            if line.contains("non-default args:") || line.contains("with config:") {
                if let Some(v) = num("'max_num_batched_tokens': ")? {
                    s.max_num_batched_tokens = Some(v);
                }
                if let Some(v) = num("'max_num_seqs': ")? {
                    s.max_num_seqs = Some(v);
                }
                if let Some(v) = num("'block_size': ")? {
                    explicit_block = Some(v);
                }
                if let Some(b) = bool_after(line, "'enable_prefix_caching': ")
                    .or_else(|| bool_after(line, "enable_prefix_caching="))
                {
                    s.prefix_caching = Some(b);
                }
                if let Some(b) = bool_after(line, "'enable_chunked_prefill': ")
                    .or_else(|| bool_after(line, "chunked_prefill_enabled="))
                {
                    s.chunked_prefill = Some(b);
                }
            }
            if line.contains("Chunked prefill is enabled with") {
                s.chunked_prefill = Some(true);
                if let Some(v) = num("max_num_batched_tokens=")? {
                    s.max_num_batched_tokens = Some(v);
                }
            }
            if let Some(v) = num("GPU KV cache size:")? {
                s.kv_cache_tokens = Some(v);
            }
            if let Some(v) = num("num_gpu_blocks is:")? {
                s.num_gpu_blocks = Some(v);
            }
        }
        s.block_size = explicit_block.or_else(|| match (s.kv_cache_tokens, s.num_gpu_blocks) {
            (Some(t), Some(b)) if b > 0 && t % b == 0 => Some(t / b),
            _ => None,
        });
        if s.kv_cache_tokens.is_none() && s.num_gpu_blocks.is_none() {
            return Err(bad(
                name,
                0,
                "no KV cache size: expected a line with \"GPU KV cache size: N tokens\" or \"num_gpu_blocks is: N\" (a vLLM V1 startup log)",
            ));
        }
        if s.block_size == Some(0) || s.num_gpu_blocks == Some(0) {
            return Err(bad(
                name,
                0,
                "a KV cache of 0 blocks: expected at least one",
            ));
        }
        Ok(s)
    }

    /// Configures `cfg`'s engines as this log states: the block size, the KV blocks, the step
    /// budget and `max_num_seqs` where it gives them, and vLLM's scheduling rules (with their
    /// incremental allocation). What the log does not state is left as it is.
    ///
    /// ```
    /// let log = kvsim::VllmLog::parse("vllm.log", "GPU KV cache size: 4,096 tokens\nnum_gpu_blocks is: 256\n")?;
    /// let mut cfg = kvsim::SimConfig::default();
    /// log.configure(&mut cfg);
    /// assert_eq!((cfg.block_size.get(), cfg.kv_blocks), (16, Some(256)));
    /// assert_eq!(cfg.scheduler, kvsim::Scheduler::Vllm);
    /// # Ok::<(), kvsim::Error>(())
    /// ```
    pub fn configure(&self, cfg: &mut SimConfig) {
        if let Some(bs) = self.block_size.and_then(|b| BlockSize::new(b).ok()) {
            cfg.block_size = bs;
        }
        if let Some(b) = self.kv_blocks(cfg.block_size.get()) {
            cfg.kv_blocks = Some(b);
        }
        if let Some(t) = self.max_num_batched_tokens {
            cfg.max_batched_tokens = t;
        }
        if let Some(n) = self.max_num_seqs {
            cfg.max_num_seqs = n;
        }
        cfg.kv_allocation = KvAllocation::Incremental;
        cfg.scheduler = Scheduler::Vllm;
    }

    /// KV blocks of `block_size` tokens the engine holds: `num_gpu_blocks` at the log's own
    /// block size, otherwise the KV cache size in tokens over `block_size` (rounded down).
    pub fn kv_blocks(&self, block_size: usize) -> Option<usize> {
        match (self.num_gpu_blocks, self.block_size, self.kv_cache_tokens) {
            (Some(b), Some(bs), _) if bs == block_size => Some(b),
            (_, _, Some(t)) if block_size > 0 => Some(t / block_size),
            (Some(b), Some(bs), None) if block_size > 0 => Some(b * bs / block_size),
            _ => None,
        }
    }
}
