//! LoRA adapters: which request `model` names are adapters the workers serve, so that a request
//! for one is hashed with the adapter's salt, as vLLM hashes it.
//!
//! vLLM keys every block of a LoRA request with the adapter's name (the first of each block's
//! extra keys) and its KV events carry the name (`lora_name`), which the router's ingestion
//! salts its re-hash with ([`kvroute::Salt::lora`]). A request must be hashed the same way, or it
//! never hits its adapter's blocks (and, hashed as the base model, it would be scored on blocks
//! the adapter cannot use). Nothing in a request says its model is an adapter rather than a base
//! model, so the router learns the adapters two ways:
//! - `--lora-modules NAME[,NAME]` (vLLM's `NAME=PATH` form accepted; the path is ignored), for
//!   adapters known before any worker answers;
//! - every worker's `/v1/models`, asked at start and every [`LEARN_EVERY`]: vLLM lists each
//!   adapter it serves (from its own `--lora-modules` or loaded at run time with
//!   `/v1/load_lora_adapter`) with the base model as its `parent`, base models with none.
//!
//! A model that is neither is hashed as a base model.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::RwLock;
use std::time::Duration;

use serde_json::Value;

/// How often the workers' `/v1/models` are asked for their adapters.
pub const LEARN_EVERY: Duration = Duration::from_secs(2);

/// The adapters a request's `model` may name.
#[derive(Debug, Default)]
pub struct Adapters {
    configured: BTreeSet<String>,
    /// By worker name: the adapters its last answer listed.
    learned: RwLock<BTreeMap<String, BTreeSet<String>>>,
}

impl Adapters {
    /// The adapters of `--lora-modules` (`NAME` or `NAME=PATH` each).
    pub fn new(configured: &[String]) -> Self {
        Adapters {
            configured: configured
                .iter()
                .map(|m| m.split_once('=').map_or(m.as_str(), |(n, _)| n).trim())
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .collect(),
            learned: RwLock::default(),
        }
    }

    /// Whether `model` is a known adapter.
    pub fn is_adapter(&self, model: &str) -> bool {
        self.configured.contains(model)
            || self
                .learned
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .any(|s| s.contains(model))
    }

    /// Every known adapter, sorted.
    pub fn names(&self) -> Vec<String> {
        let learned = self.learned.read().unwrap_or_else(|e| e.into_inner());
        let mut all = self.configured.clone();
        all.extend(learned.values().flatten().cloned());
        all.into_iter().collect()
    }

    /// Learns from one round of `/v1/models` answers, one per current worker by name (`None`:
    /// it did not answer). A worker that answered is known to serve what it lists; one that did
    /// not keeps what it listed before (a missed poll must not hash its adapters' requests as
    /// the base model's); a worker no longer listed is forgotten.
    pub fn learn<'a>(&self, answers: impl IntoIterator<Item = (&'a str, Option<&'a Value>)>) {
        let mut learned = self.learned.write().unwrap_or_else(|e| e.into_inner());
        let mut present = BTreeSet::new();
        for (worker, answer) in answers {
            present.insert(worker.to_string());
            if let Some(a) = answer {
                learned.insert(worker.to_string(), listed(a).map(str::to_string).collect());
            }
        }
        learned.retain(|w, _| present.contains(w));
    }
}

/// The adapters a `/v1/models` answer lists: the ids of entries with a string `parent`.
///
/// ```
/// let v = serde_json::json!({"data": [{"id": "base", "parent": null},
///                                     {"id": "my-lora", "parent": "base"}]});
/// assert_eq!(kvrouter::lora::listed(&v).collect::<Vec<_>>(), ["my-lora"]);
/// ```
pub fn listed(models: &Value) -> impl Iterator<Item = &str> {
    models["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["parent"].is_string())
        .filter_map(|m| m["id"].as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_and_learned_adapters_are_known() {
        let a = Adapters::new(&["sql-lora=/adapters/sql".into(), " ".into()]);
        assert!(a.is_adapter("sql-lora") && !a.is_adapter("base") && !a.is_adapter(" "));
        let v = serde_json::json!({"data": [{"id": "base", "parent": null},
                                            {"id": "chat-lora", "parent": "base"}]});
        let none = serde_json::json!({"data": []});
        a.learn([("w0", Some(&v)), ("w1", Some(&none))]);
        assert!(a.is_adapter("chat-lora"));
        assert_eq!(a.names(), ["chat-lora", "sql-lora"]);
        // A worker that misses a poll keeps what it listed; one that answers without it, or
        // leaves, forgets it.
        a.learn([("w0", None), ("w1", Some(&none))]);
        assert!(a.is_adapter("chat-lora"));
        a.learn([("w0", Some(&none)), ("w1", None)]);
        assert!(!a.is_adapter("chat-lora") && a.is_adapter("sql-lora"));
        a.learn([("w0", Some(&v))]);
        a.learn([("w1", None)]);
        assert!(!a.is_adapter("chat-lora"));
    }
}
