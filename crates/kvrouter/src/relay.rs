//! `kvrouter relay`: one engine's ZMQ KV events into the JetStream stream, each batch once and
//! in order.
//!
//! The relay subscribes to the engine's publisher. Before publishing a batch it publishes what
//! a gap says it missed, fetched from the engine's replay socket. Each message carries the
//! engine's sequence number ([`SEQ_HEADER`]) and is published with a message id made of the
//! worker, the publisher's run ([`EPOCH_HEADER`]) and that number, and the relay waits for
//! JetStream's acknowledgement before the next: a retry after a lost acknowledgement (or a
//! relay restarted in between) is dropped by JetStream's de-duplication. A restarted relay
//! reads the last message of its subject to learn where it was.

use std::time::Duration;

use async_nats::HeaderMap;
use bytes::Bytes;
use kvroute_vllm::parse_seq_frame;
use zeromq::SocketRecv;

use crate::config::RelayArgs;
use crate::events::{fetch_replay, subscribe};
use crate::nats::{
    connect, events_stream, header_u64, last_on_subject, subject_of, Nats, EPOCH_HEADER, SEQ_HEADER,
};

/// Where the relay is in the engine's stream: the publisher's run and the last batch
/// published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Published {
    epoch: u64,
    seq: u64,
}

/// Runs the relay until `shutdown` resolves.
pub async fn run(
    args: RelayArgs,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), String> {
    let flag = |e: String| format!("--nats-url {}: {e}", args.nats_url);
    let nats = connect(&args.nats_url, Duration::from_secs(30))
        .await
        .map_err(flag)?;
    let stream = events_stream(&nats.js).await.map_err(flag)?;
    let subject = subject_of(&args.worker.name);
    // Where this worker's stream is; an error is retried, never taken for an empty subject
    // (which would publish the engine's batches again as a new run).
    let last = loop {
        match last_on_subject(&stream, &subject).await {
            Ok(m) => break m,
            Err(e) => {
                tracing::warn!("{e} (retrying)");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    };
    let mut at = last.map(|m| Published {
        epoch: header_u64(Some(&m.headers), EPOCH_HEADER).unwrap_or(0),
        seq: header_u64(Some(&m.headers), SEQ_HEADER).unwrap_or(0),
    });
    let events = args.worker.events.clone().unwrap_or_default();
    tracing::info!(
        "{events} -> {subject} (last published: {})",
        at.map_or("none".to_string(), |p| format!(
            "batch {} of run {}",
            p.seq, p.epoch
        ))
    );
    let work = async {
        loop {
            let mut sub = subscribe(&events).await;
            while let Ok(msg) = sub.recv().await {
                let frames = msg.into_vec();
                let [_, seq, payload] = &frames[..] else {
                    tracing::warn!("a message of {} frames (expected 3): dropped", frames.len());
                    continue;
                };
                let Ok(seq) = parse_seq_frame(seq) else {
                    tracing::warn!("a sequence frame of {} bytes: dropped", seq.len());
                    continue;
                };
                at = Some(relay(&nats, &subject, &args, at, seq, payload.clone()).await);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        () = work => Ok(()),
        () = shutdown => Ok(()),
    }
}

/// Publishes batch `seq`, after the batches a gap says were missed; returns where the relay
/// is then.
async fn relay(
    nats: &Nats,
    subject: &str,
    args: &RelayArgs,
    at: Option<Published>,
    seq: u64,
    payload: Bytes,
) -> Published {
    let (epoch, expected) = match at {
        None => (0, 0),
        // A live publisher never repeats a number: it started over.
        Some(p) if seq <= p.seq => {
            tracing::warn!(
                "{} started over (batch {seq} after {})",
                args.worker.name,
                p.seq
            );
            (p.epoch + 1, 0)
        }
        Some(p) => (p.epoch, p.seq + 1),
    };
    if seq > expected {
        if let Some(replay) = &args.worker.replay {
            match fetch_replay(replay, expected).await {
                Ok(batches) => {
                    for (s, p) in batches.into_iter().filter(|(s, _)| *s < seq) {
                        publish(nats, subject, epoch, s, p).await;
                    }
                }
                Err(e) => tracing::warn!(
                    "replay of batches {expected}..{seq} from {replay} failed: {e}; the gap stays"
                ),
            }
        }
    }
    publish(nats, subject, epoch, seq, payload).await;
    Published { epoch, seq }
}

/// Publishes one batch and waits for JetStream's acknowledgement, retrying until it comes
/// (the message id makes a retry of a stored message a no-op).
async fn publish(nats: &Nats, subject: &str, epoch: u64, seq: u64, payload: Bytes) {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", format!("{subject}.{epoch}.{seq}").as_str());
    headers.insert(SEQ_HEADER, seq.to_string().as_str());
    headers.insert(EPOCH_HEADER, epoch.to_string().as_str());
    let mut wait = Duration::from_millis(50);
    loop {
        let sent = nats
            .js
            .publish_with_headers(subject.to_string(), headers.clone(), payload.clone())
            .await;
        let acked = match sent {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        match acked {
            Ok(()) => return,
            Err(e) => {
                tracing::warn!("batch {seq} not stored yet: {e} (retrying)");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(2));
                // The stream may be gone (deleted, or a NATS server that lost its store).
                let _ = events_stream(&nats.js).await;
            }
        }
    }
}
