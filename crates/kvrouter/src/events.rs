//! KV events: one ZMQ SUB per worker, decoded and applied by `kvroute_vllm`; missed batches are
//! fetched from the worker's replay socket before the batch that revealed the gap.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_vllm::{parse_seq_frame, IngestSummary, VllmError};
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::state::{Server, Worker};

/// How long a replay may take before it is given up (the gap is then recorded as stale).
const REPLAY_TIMEOUT: Duration = Duration::from_secs(2);

/// Subscribes to `worker`'s events and applies them until the process ends; reconnects when
/// the connection cannot be made.
pub async fn follow(server: Arc<Server>, worker: Arc<Worker>) {
    let Some(endpoint) = worker.spec.events.clone() else {
        return;
    };
    loop {
        let mut sub = subscribe(&endpoint).await;
        worker.subscribed.store(true, Ordering::Release);
        while let Ok(msg) = sub.recv().await {
            let frames = msg.into_vec();
            on_message(&server, &worker, &frames).await;
        }
        worker.subscribed.store(false, Ordering::Release);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A SUB socket subscribed to everything `endpoint` publishes, retried until it connects.
pub async fn subscribe(endpoint: &str) -> zeromq::SubSocket {
    loop {
        let mut sub = zeromq::SubSocket::new();
        let connected = tokio::time::timeout(Duration::from_secs(5), sub.connect(endpoint)).await;
        if matches!(connected, Ok(Ok(()))) && sub.subscribe("").await.is_ok() {
            return sub;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Applies one multipart message, first replaying what a sequence gap says was missed.
pub async fn on_message(server: &Server, worker: &Worker, frames: &[Bytes]) {
    let [_, seq, payload] = frames else {
        // Counted and logged as the adapter rejects it.
        let r = {
            let mut m = server.mirror();
            let m = &mut *m;
            m.ingest.apply_multipart(&mut m.router, worker.id, frames)
        };
        count(server, worker, &r);
        return;
    };
    let seq = match parse_seq_frame(seq) {
        Ok(seq) => seq,
        Err(e) => {
            count(server, worker, &Err(e));
            return;
        }
    };
    if let Some(replay) = &worker.spec.replay {
        // After a restart, the new run's missed batches are replayed from its batch 0.
        restart_if_repeated(server, worker, seq);
        let expected = server.mirror().ingest.next_seq(worker.id);
        if seq > expected {
            server.counters.replays.fetch_add(1, Ordering::Relaxed);
            match fetch_replay(replay, expected).await {
                Ok(batches) => {
                    for (s, payload) in batches.into_iter().filter(|(s, _)| *s < seq) {
                        if apply_batch(server, worker, s, &payload, None) {
                            server
                                .counters
                                .replayed_batches
                                .fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                Err(e) => tracing::warn!(
                    "replay from {} of worker {} failed: {e}",
                    replay,
                    worker.spec.name
                ),
            }
        }
    }
    apply_batch(server, worker, seq, payload, None);
}

/// Applies one batch of `worker` with its publisher's sequence number, and records `position`
/// (the transport's, kept in snapshots) in the same step; true when applied. A number below the
/// expected one other than 0 means the publisher restarted and its batch 0 was missed: the
/// mirror starts afresh.
pub fn apply_batch(
    server: &Server,
    worker: &Worker,
    seq: u64,
    payload: &[u8],
    position: Option<u64>,
) -> bool {
    restart_if_repeated(server, worker, seq);
    let r = {
        let mut m = server.mirror();
        let m = &mut *m;
        let r = m
            .ingest
            .apply_payload(&mut m.router, worker.id, Some(seq), payload);
        if position.is_some() && m.router.index().worker_index(worker.id).is_some() {
            // Consumed even when rejected: the stream moves past a batch that cannot apply.
            // (Not for a worker removed meanwhile: its feed went with it.)
            m.ingest.set_position(worker.id, position);
        }
        r
    };
    count(server, worker, &r)
}

/// A sequence number below the expected one, other than 0: a live publisher never sends a
/// number twice, so it restarted and its batch 0 was missed (a subscription still
/// reconnecting). The worker's mirror starts afresh.
fn restart_if_repeated(server: &Server, worker: &Worker, seq: u64) {
    let mut m = server.mirror();
    let m = &mut *m;
    if seq != 0 && seq < m.ingest.next_seq(worker.id) {
        m.router.clear_worker(worker.id);
        m.ingest.forget_worker(worker.id);
        server.counters.restarts.fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts an applied or rejected batch; true when applied.
fn count(server: &Server, worker: &Worker, r: &Result<IngestSummary, VllmError>) -> bool {
    let c = &server.counters;
    match r {
        Ok(s) => {
            c.batches_applied.fetch_add(1, Ordering::Relaxed);
            server.heard_from(worker);
            if s.published_us > 0 {
                let now_us = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_micros() as u64);
                server
                    .kv_event_lag
                    .observe(now_us.saturating_sub(s.published_us));
            }
            c.gaps
                .fetch_add(u64::from(s.gap.is_some()), Ordering::Relaxed);
            true
        }
        Err(e) => {
            c.batches_rejected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "KV-event batch of worker {} rejected: {e}",
                worker.spec.name
            );
            false
        }
    }
}

/// Asks a vLLM replay (ROUTER) socket for every batch from `start`: the (seq, payload) pairs
/// before its end marker (sequence number -1).
pub async fn fetch_replay(endpoint: &str, start: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let work = async {
        let mut d = zeromq::DealerSocket::new();
        d.connect(endpoint).await.map_err(|e| e.to_string())?;
        let mut m = ZmqMessage::from(Bytes::new());
        m.push_back(Bytes::copy_from_slice(&kvroute_vllm::seq_frame(start)));
        d.send(m).await.map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        loop {
            let msg = d.recv().await.map_err(|e| e.to_string())?.into_vec();
            // [empty delimiter, seq, payload]
            let [_, seq, payload] = &msg[..] else {
                return Err(format!("a replay message of {} frames", msg.len()));
            };
            match kvroute_vllm::parse_replay_seq(seq).map_err(|e| e.to_string())? {
                Some(seq) => out.push((seq, payload.clone())),
                None => return Ok(out),
            }
        }
    };
    tokio::time::timeout(REPLAY_TIMEOUT, work)
        .await
        .map_err(|_| format!("no end marker within {REPLAY_TIMEOUT:?}"))?
}
