//! Where workers come from: the static `--worker` list, or etcd records that appear and go.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kvserve::etcd::{Etcd, WorkerRecord, PREFIX};

use crate::config::{EventTransport, WorkerSpec};
use crate::events;
use crate::state::{Server, Worker};

/// How often the etcd prefix is read.
const POLL: Duration = Duration::from_millis(500);

/// Starts `worker`'s KV-event subscription, stopped when the worker is removed.
pub fn follow_events(server: &Arc<Server>, worker: &Arc<Worker>) {
    let (s, w) = (Arc::clone(server), Arc::clone(worker));
    let task = match server.cfg.kv_event_transport {
        EventTransport::Zmq => tokio::spawn(events::follow(s, w)),
        EventTransport::Nats => tokio::spawn(crate::feeds::follow(s, w)),
    };
    if let Ok(mut t) = worker.task.lock() {
        *t = Some(task.abort_handle());
    }
}

/// The worker a record describes, or why it is refused.
pub fn spec_of(server: &Server, key: &str, value: &str) -> Result<WorkerSpec, String> {
    let rec: WorkerRecord =
        serde_json::from_str(value).map_err(|e| format!("{key}: not a worker record: {e}"))?;
    if rec.block_size != server.cfg.block_size {
        return Err(format!(
            "{key}: block size {} differs from the router's {} (--block-size): refused",
            rec.block_size, server.cfg.block_size
        ));
    }
    let mut spec: WorkerSpec = rec.url.parse().map_err(|e| format!("{key}: {e}"))?;
    spec.events = rec.events;
    spec.replay = rec.replay;
    Ok(spec)
}

/// Reads etcd's worker records twice a second: a new key adds its worker, a key that went (or
/// whose lease lapsed) removes it, a changed record replaces it. Workers of the `--worker` list
/// are never removed here.
pub async fn watch_etcd(server: Arc<Server>, endpoint: String) {
    let etcd = Etcd::new(&endpoint);
    // key -> (record text, worker name), for the workers this watch added.
    let mut known: BTreeMap<String, (String, String)> = BTreeMap::new();
    let mut refused: BTreeMap<String, String> = BTreeMap::new();
    let mut unreachable = false;
    loop {
        match etcd.range_prefix(PREFIX).await {
            Err(e) => {
                if !unreachable {
                    tracing::warn!("etcd discovery: {e} (retrying)");
                }
                unreachable = true;
            }
            Ok(kvs) => {
                unreachable = false;
                let now: BTreeMap<String, String> = kvs.into_iter().collect();
                let gone: Vec<String> = known
                    .iter()
                    .filter(|(k, (v, _))| now.get(*k) != Some(v))
                    .map(|(k, _)| k.clone())
                    .collect();
                for k in gone {
                    if let Some((_, name)) = known.remove(&k) {
                        // Its in-flight requests finish; it leaves once they have.
                        server.set_draining(&name, true);
                        tracing::info!("worker {name} left ({k}): draining");
                    }
                }
                refused.retain(|k, v| now.get(k) == Some(v));
                for (k, v) in &now {
                    if known.contains_key(k) || refused.contains_key(k) {
                        continue;
                    }
                    let spec = match spec_of(&server, k, v) {
                        Ok(spec) => spec,
                        Err(e) => {
                            tracing::warn!("etcd discovery: {e}");
                            refused.insert(k.clone(), v.clone());
                            continue;
                        }
                    };
                    // Back before its drain ended: it stays, and is no longer draining.
                    if server
                        .worker_named(&spec.name)
                        .is_some_and(|w| w.draining.load(std::sync::atomic::Ordering::Relaxed))
                    {
                        server.set_draining(&spec.name, false);
                        known.insert(k.clone(), (v.clone(), spec.name.clone()));
                        continue;
                    }
                    let added = server.add_worker(spec);
                    match added {
                        Ok(w) => {
                            tracing::info!("worker {} joined ({k})", w.spec.name);
                            follow_events(&server, &w);
                            known.insert(k.clone(), (v.clone(), w.spec.name.clone()));
                        }
                        Err(e) => {
                            tracing::warn!("etcd discovery: {e}");
                            refused.insert(k.clone(), v.clone());
                        }
                    }
                }
            }
        }
        tokio::time::sleep(POLL).await;
    }
}
