//! The NATS connection and its names: the JetStream stream of KV events that `kvrouter relay`
//! fills (one subject per worker, durable, so a restarted replica catches up), the subjects of
//! replica load deltas, the object store of mirror snapshots, and the headers on each message.
//! A leaf: what the router does with them is in `feeds`.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

/// The JetStream stream of every worker's KV-event batches.
pub const STREAM: &str = "KVKIT_EVENTS";
/// Subjects of [`STREAM`]: this, then the worker's name made subject-safe ([`subject_of`]).
pub const EVENTS_PREFIX: &str = "kvkit.events.";
/// Load deltas of replica N go on `kvkit.load.N`.
pub const LOAD_PREFIX: &str = "kvkit.load.";
/// The object store of mirror snapshots, and the object's name.
pub const SNAPSHOT_BUCKET: &str = "kvkit-snapshots";
pub(crate) const SNAPSHOT_OBJECT: &str = "mirror";
/// The engine's batch sequence number, on every message of [`STREAM`].
pub const SEQ_HEADER: &str = "Kvkit-Seq";
/// How many times the relay saw the engine's publisher start over (so message ids differ).
pub const EPOCH_HEADER: &str = "Kvkit-Epoch";

/// A NATS connection and its JetStream context.
#[derive(Clone)]
pub(crate) struct Nats {
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
}

impl std::fmt::Debug for Nats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nats")
    }
}

/// The subject of `worker`'s events: `kvkit.events.` and its name with every character
/// other than letters, digits, `-` and `_` made `_` (`127.0.0.1:30000` is
/// `kvkit.events.127_0_0_1_30000`).
///
/// ```
/// assert_eq!(kvrouter::nats::subject_of("127.0.0.1:30000"), "kvkit.events.127_0_0_1_30000");
/// ```
pub fn subject_of(worker: &str) -> String {
    let safe: String = worker
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{EVENTS_PREFIX}{safe}")
}

/// Connects (retrying until the server answers, at most `wait`).
pub(crate) async fn connect(url: &str, wait: Duration) -> Result<Nats, String> {
    let opts = async_nats::ConnectOptions::new()
        .retry_on_initial_connect()
        .connection_timeout(Duration::from_secs(2));
    let client = tokio::time::timeout(wait, opts.connect(url))
        .await
        .map_err(|_| format!("{url}: no NATS server answered within {wait:?}"))?
        .map_err(|e| format!("{url}: {e}"))?;
    let js = jetstream::new(client.clone());
    Ok(Nats { client, js })
}

/// The events stream, created when absent (file storage, so a NATS restart keeps it).
pub(crate) async fn events_stream(js: &jetstream::Context) -> Result<stream::Stream, String> {
    js.get_or_create_stream(stream::Config {
        name: STREAM.to_string(),
        subjects: vec![format!("{EVENTS_PREFIX}>")],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("JetStream stream {STREAM}: {e} (is the server run with -js?)"))
}

/// The last message on `subject`: `None` when it has none; an error for anything else (the
/// caller retries rather than take a failure for an empty subject).
pub(crate) async fn last_on_subject(
    stream: &stream::Stream,
    subject: &str,
) -> Result<Option<async_nats::jetstream::message::StreamMessage>, String> {
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(m) => Ok(Some(m)),
        Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) if e.to_string().contains("no message found") => Ok(None),
        Err(e) => Err(format!("the last message of {subject}: {e}")),
    }
}

/// A header's value as a number.
pub(crate) fn header_u64(h: Option<&async_nats::HeaderMap>, name: &str) -> Option<u64> {
    h?.get(name)?.as_str().parse().ok()
}
