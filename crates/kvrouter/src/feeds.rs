//! The router's NATS feeds: KV events followed from the JetStream stream (applied to the
//! mirror like ZMQ batches), snapshots of the mirror stored and loaded, load deltas shared
//! between replicas, and the catch-up at start.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{consumer, object_store, stream};
use futures_util::StreamExt;
use kvroute::{LoadDelta, WorkerId};
use kvroute_vllm::MirrorSnapshot;
use serde_json::Value;
use tokio::io::AsyncReadExt;

use crate::events::apply_batch;
use crate::nats::{
    events_stream, header_u64, last_on_subject, subject_of, Nats, EPOCH_HEADER, LOAD_PREFIX,
    SEQ_HEADER, SNAPSHOT_BUCKET, SNAPSHOT_OBJECT,
};
use crate::state::{Server, Worker};

/// Follows `worker`'s subject of the events stream from after its recorded position (from its
/// start without one) and applies each batch; reconnects after an error.
pub(crate) async fn follow(server: Arc<Server>, worker: Arc<Worker>) {
    let Some(nats) = server.nats.get().cloned() else {
        return;
    };
    let subject = subject_of(&worker.spec.name);
    loop {
        if let Err(e) = follow_once(&server, &worker, &nats, &subject).await {
            tracing::warn!(
                "JetStream events of worker {}: {e} (retrying)",
                worker.spec.name
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn follow_once(
    server: &Server,
    worker: &Worker,
    nats: &Nats,
    subject: &str,
) -> Result<(), String> {
    let mut stream = events_stream(&nats.js).await?;
    let last = stream
        .info()
        .await
        .map_err(|e| e.to_string())?
        .state
        .last_sequence;
    let mut position = server.mirror().ingest.position(worker.id);
    if position.is_some_and(|p| p > last) {
        // The stream is younger than the mirror (it was deleted, or NATS lost its store):
        // what the mirror holds cannot be followed; start it afresh from the new stream.
        tracing::warn!(
            "the events stream ends before worker {}'s position: its mirror starts afresh",
            worker.spec.name
        );
        let mut m = server.mirror();
        let m = &mut *m;
        m.router.clear_worker(worker.id);
        m.ingest.forget_worker(worker.id);
        position = None;
    }
    // The publisher run of the last batch applied, so that a stored duplicate is dropped and
    // a new run starts the mirror afresh.
    let mut epoch = match position {
        Some(p) => stream
            .get_raw_message(p)
            .await
            .ok()
            .and_then(|m| header_u64(Some(&m.headers), EPOCH_HEADER)),
        None => None,
    };
    let deliver_policy = match position {
        Some(p) => consumer::DeliverPolicy::ByStartSequence {
            start_sequence: p + 1,
        },
        None => consumer::DeliverPolicy::All,
    };
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            filter_subject: subject.to_string(),
            deliver_policy,
            ..Default::default()
        })
        .await
        .map_err(|e| e.to_string())?;
    let mut messages = consumer.messages().await.map_err(|e| e.to_string())?;
    while let Some(msg) = messages.next().await {
        let msg = msg.map_err(|e| e.to_string())?;
        let (position, pending) = match msg.info() {
            Ok(i) => (i.stream_sequence, i.pending),
            Err(e) => return Err(format!("a message without its stream position: {e}")),
        };
        let run = header_u64(msg.headers.as_ref(), EPOCH_HEADER).unwrap_or(0);
        match header_u64(msg.headers.as_ref(), SEQ_HEADER) {
            Some(seq) if is_duplicate(server, worker, epoch, run, seq) => {
                // Stored twice (a relay retried after JetStream's de-duplication window): the
                // batch was applied already.
                skip(server, worker, position);
            }
            Some(seq) => {
                if epoch.is_some_and(|e| run > e) && seq != 0 {
                    // A new publisher run whose batch 0 the relay could not replay.
                    let mut m = server.mirror();
                    let m = &mut *m;
                    m.router.clear_worker(worker.id);
                    m.ingest.forget_worker(worker.id);
                    server.counters.restarts.fetch_add(1, Ordering::Relaxed);
                }
                epoch = Some(run);
                apply_batch(server, worker, seq, &msg.payload, Some(position));
            }
            None => {
                skip(server, worker, position);
                tracing::warn!(
                    "message {position} of {subject} has no {SEQ_HEADER} header: skipped"
                );
            }
        }
        if pending == 0 {
            worker.caught_up.store(true, Ordering::Relaxed);
        }
    }
    Err("the consumer ended".to_string())
}

/// Counts the message at `position` as rejected and moves past it.
fn skip(server: &Server, worker: &Worker, position: u64) {
    server
        .counters
        .batches_rejected
        .fetch_add(1, Ordering::Relaxed);
    server
        .mirror()
        .ingest
        .set_position(worker.id, Some(position));
}

/// Whether batch `seq` of publisher run `run` is older than what the mirror applied (run
/// `epoch`, up to its next expected number).
fn is_duplicate(server: &Server, worker: &Worker, epoch: Option<u64>, run: u64, seq: u64) -> bool {
    match epoch {
        Some(e) if run < e => true,
        Some(e) if run == e => seq < server.mirror().ingest.next_seq(worker.id),
        _ => false,
    }
}

/// The newest snapshot in the object store, if any: (worker ids by name, the mirror).
pub(crate) async fn load_snapshot(
    nats: &Nats,
) -> Result<Option<(BTreeMap<String, WorkerId>, MirrorSnapshot)>, String> {
    let Ok(store) = nats.js.get_object_store(SNAPSHOT_BUCKET).await else {
        return Ok(None);
    };
    let Ok(mut object) = store.get(SNAPSHOT_OBJECT).await else {
        return Ok(None);
    };
    let mut bytes = Vec::new();
    object
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| format!("reading snapshot {SNAPSHOT_BUCKET}/{SNAPSHOT_OBJECT}: {e}"))?;
    let s: Stored = serde_json::from_slice(&bytes)
        .map_err(|e| format!("snapshot {SNAPSHOT_BUCKET}/{SNAPSHOT_OBJECT}: {e}"))?;
    Ok(Some((s.workers, s.mirror)))
}

/// A snapshot as stored: the mirror and the names of the router ids it uses.
#[derive(serde::Serialize, serde::Deserialize)]
struct Stored {
    workers: BTreeMap<String, WorkerId>,
    mirror: MirrorSnapshot,
}

/// Stores a snapshot after every `every` batches applied (checked once a second).
pub(crate) async fn snapshot_loop(server: Arc<Server>, every: u64) {
    let Some(nats) = server.nats.get().cloned() else {
        return;
    };
    let mut last = server.counters.batches_applied.load(Ordering::Relaxed);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = server.counters.batches_applied.load(Ordering::Relaxed);
        if now.saturating_sub(last) < every {
            continue;
        }
        match save_snapshot(&server, &nats).await {
            Ok(bytes) => {
                last = now;
                server.counters.snapshots.fetch_add(1, Ordering::Relaxed);
                tracing::debug!("snapshot stored ({bytes} bytes)");
            }
            Err(e) => tracing::warn!("snapshot not stored: {e}"),
        }
    }
}

async fn save_snapshot(server: &Server, nats: &Nats) -> Result<usize, String> {
    let (workers, mirror) = server.snapshot_state();
    let stored = Stored { workers, mirror };
    let bytes = serde_json::to_vec(&stored).map_err(|e| e.to_string())?;
    let store = match nats.js.get_object_store(SNAPSHOT_BUCKET).await {
        Ok(s) => s,
        Err(_) => nats
            .js
            .create_object_store(object_store::Config {
                bucket: SNAPSHOT_BUCKET.to_string(),
                storage: stream::StorageType::File,
                ..Default::default()
            })
            .await
            .map_err(|e| format!("object store {SNAPSHOT_BUCKET}: {e}"))?,
    };
    store
        .put(SNAPSHOT_OBJECT, &mut bytes.as_slice())
        .await
        .map_err(|e| format!("object store {SNAPSHOT_BUCKET}: {e}"))?;
    Ok(bytes.len())
}

/// Publishes this replica's load deltas on `kvkit.load.<replica>`, one message per flush,
/// naming workers by their names (router ids are each replica's own).
pub(crate) async fn publish_deltas(
    server: Arc<Server>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<Vec<LoadDelta>>,
) {
    let Some(nats) = server.nats.get().cloned() else {
        return;
    };
    let subject = format!("{LOAD_PREFIX}{}", server.replica);
    while let Some(deltas) = rx.recv().await {
        let names: BTreeMap<WorkerId, String> = server
            .worker_ids()
            .into_iter()
            .map(|(n, id)| (id, n))
            .collect();
        let wire: Vec<Value> = deltas
            .iter()
            .filter_map(|d| {
                let mut v = serde_json::to_value(d).ok()?;
                if let Some(w) = v.pointer_mut("/change/worker") {
                    let id = WorkerId::new(w.as_u64()?);
                    *w = Value::String(names.get(&id)?.clone());
                }
                Some(v)
            })
            .collect();
        let Ok(bytes) = serde_json::to_vec(&wire) else {
            continue;
        };
        if let Err(e) = nats.client.publish(subject.clone(), bytes.into()).await {
            tracing::warn!("load deltas not published: {e}");
        }
    }
}

/// Applies the other replicas' load deltas, and lets their load lapse when its finish never
/// comes.
pub(crate) async fn apply_deltas(server: Arc<Server>) {
    let Some(nats) = server.nats.get().cloned() else {
        return;
    };
    let mut sub = match nats.client.subscribe(format!("{LOAD_PREFIX}>")).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("cannot subscribe to load deltas: {e}");
            return;
        }
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            msg = sub.next() => {
                let Some(msg) = msg else { return };
                if msg.subject.as_str() == format!("{LOAD_PREFIX}{}", server.replica) {
                    continue;
                }
                apply_wire_deltas(&server, &msg.payload);
            }
            _ = tick.tick() => {
                let now = server.started.elapsed();
                server.mirror().router.expire_remote_load(now);
            }
        }
    }
}

fn apply_wire_deltas(server: &Server, payload: &[u8]) {
    let Ok(Value::Array(list)) = serde_json::from_slice::<Value>(payload) else {
        server
            .counters
            .deltas_rejected
            .fetch_add(1, Ordering::Relaxed);
        return;
    };
    let ids = server.worker_ids();
    let now = server.started.elapsed();
    let mut m = server.mirror();
    for mut v in list {
        if let Some(w) = v.pointer_mut("/change/worker") {
            // A worker this replica does not know: the delta cannot count here.
            let Some(id) = w.as_str().and_then(|n| ids.get(n)) else {
                continue;
            };
            *w = Value::from(id.get());
        }
        match serde_json::from_value::<LoadDelta>(v) {
            Ok(d) => {
                m.router.apply_load_delta(&d, now);
                server
                    .counters
                    .deltas_applied
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                server
                    .counters
                    .deltas_rejected
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Waits until every worker's follower has read its subject to the end as it was when it
/// started (a worker with no events is caught up at once). Returns how long it took.
pub(crate) async fn catch_up(server: &Server, nats: &Nats) -> Result<Duration, String> {
    let started = Instant::now();
    let stream = events_stream(&nats.js).await?;
    for w in server.workers() {
        let subject = subject_of(&w.spec.name);
        let last = loop {
            match last_on_subject(&stream, &subject).await {
                Ok(m) => break m.map(|m| m.sequence),
                Err(e) => {
                    tracing::warn!("catching up: {e} (retrying)");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        };
        let done =
            || w.caught_up.load(Ordering::Relaxed) || server.mirror().ingest.position(w.id) >= last;
        let mut waited = Instant::now();
        while !done() {
            if waited.elapsed() >= Duration::from_secs(5) {
                tracing::info!(
                    "still catching up with worker {}'s events (at {:?} of {last:?})",
                    w.spec.name,
                    server.mirror().ingest.position(w.id)
                );
                waited = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    Ok(started.elapsed())
}
