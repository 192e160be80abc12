//! vLLM's KV-event wire: the engine-private block hashes, the two MessagePack shapes of an
//! `EventBatch`, and the ZMQ publisher with its replay socket.
//!
//! - PUB socket: one multipart message per batch, `[topic, seq (u64 big-endian), payload]`,
//!   `seq` counting from 0 per process (so a restart starts again at 0).
//! - ROUTER replay socket: a request `[identity, (empty), start_seq (8 bytes BE)]` is answered
//!   with every buffered batch whose sequence number is at least `start_seq`, each as
//!   `[identity, empty, seq, payload]`, then the end marker `[identity, empty, -1 (i64 BE), ""]`,
//!   as vLLM's `ZmqEventPublisher` does. The buffer keeps the last `buffer_steps` batches.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvroute_vllm::{EngineEvent, EventBatch};

use serde::Deserialize;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::error::MockError;

/// The seed of the engine-private block hash (not kvblock's 1337: routers must re-hash).
const ENGINE_HASH_SEED: u64 = 0x6b76_6d6f_636b_5f31; // "kvmock_1"

/// The engine's own hash of a block: XXH3-64 over the parent's engine hash and the block's
/// tokens (little-endian), with a private seed. A function of the tokens of the block and its
/// whole prefix, like vLLM's, and never equal to kvblock's.
pub fn engine_block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut bytes = Vec::with_capacity(8 + tokens.len() * 4);
    bytes.extend_from_slice(&parent.unwrap_or(0).to_le_bytes());
    for t in tokens {
        bytes.extend_from_slice(&t.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64_with_seed(&bytes, ENGINE_HASH_SEED)
}

/// How batches are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WireShape {
    /// Events as maps tagged `"type"` (vLLM's current shape; `None` fields with a default
    /// omitted).
    #[default]
    Map,
    /// Events as tagged arrays (the older, positional shape).
    Array,
}

impl std::str::FromStr for WireShape {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "map" => Ok(WireShape::Map),
            "array" => Ok(WireShape::Array),
            _ => Err(format!("expected map or array, got {s:?}")),
        }
    }
}

/// Encodes a batch in the given shape.
pub fn encode_batch(batch: &EventBatch, shape: WireShape) -> Vec<u8> {
    match shape {
        WireShape::Array => batch.to_msgpack(),
        WireShape::Map => batch.to_msgpack_map(),
    }
}

/// vLLM's `--kv-events-config`: the fields it has (unknown ones are ignored, as vLLM's own
/// parser would reject only what it cannot map).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(default)]
pub struct KvEventsConfig {
    /// Publish events at all (`--enable-kv-events` sets it too).
    pub enable_kv_cache_events: bool,
    /// `"zmq"` (or `"null"`: publish nothing).
    pub publisher: String,
    /// The PUB endpoint: `tcp://*:5557` (or a loopback address) binds; another host is
    /// connected to (a proxy).
    pub endpoint: String,
    /// The ROUTER replay endpoint (bound), if any, e.g. `tcp://*:5558`.
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// The topic frame.
    pub topic: String,
    /// ZMQ high-water mark (accepted; the pure-Rust ZMQ has no setting for it).
    pub hwm: u64,
    /// Queue of batches before publishing (accepted; the queue here is unbounded).
    pub max_queue_size: u64,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: false,
            publisher: "zmq".into(),
            endpoint: "tcp://*:5557".into(),
            replay_endpoint: None,
            buffer_steps: 10_000,
            topic: String::new(),
            hwm: 100_000,
            max_queue_size: 100_000,
        }
    }
}

/// `tcp://host:port` with the port moved by `offset` (vLLM offsets a data-parallel rank's
/// endpoints by its rank), and `*` as the wildcard address the pure-Rust ZMQ understands.
pub fn endpoint_for(endpoint: &str, offset: u16) -> Result<String, MockError> {
    let bad = || MockError::Config {
        flag: "--kv-events-config",
        message: format!("endpoint {endpoint:?}: expected tcp://HOST:PORT"),
    };
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let port = port.checked_add(offset).ok_or_else(bad)?;
    let host = if host == "*" { "0.0.0.0" } else { host };
    Ok(format!("tcp://{host}:{port}"))
}

/// Whether the PUB socket binds `endpoint` (a wildcard or a loopback address, as a server
/// would) rather than connecting to it (another host: a proxy).
pub fn binds(endpoint: &str) -> bool {
    let host = endpoint
        .strip_prefix("tcp://")
        .and_then(|r| r.rsplit_once(':'))
        .map_or("", |(h, _)| h);
    matches!(host, "*" | "0.0.0.0" | "localhost" | "[::]" | "[::1]") || host.starts_with("127.")
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// A started publisher: send it batches of events, in order.
#[derive(Debug, Clone)]
pub struct Publisher {
    tx: mpsc::UnboundedSender<Vec<EngineEvent>>,
}

impl Publisher {
    /// Queues one batch (one engine step's events).
    pub fn publish(&self, events: Vec<EngineEvent>) {
        let _ = self.tx.send(events);
    }

    /// Binds (or connects) the PUB socket and binds the replay socket, then publishes every
    /// batch sent to the returned handle from a task of the current runtime.
    pub async fn start(
        cfg: &KvEventsConfig,
        shape: WireShape,
        data_parallel_rank: Option<i64>,
    ) -> Result<Publisher, MockError> {
        let offset = u16::try_from(data_parallel_rank.unwrap_or(0)).unwrap_or(0);
        let endpoint = endpoint_for(&cfg.endpoint, offset)?;
        let mut publ = zeromq::PubSocket::new();
        if binds(&cfg.endpoint) {
            publ.bind(&endpoint)
                .await
                .map_err(|e| MockError::Io(format!("kv events endpoint {endpoint}: {e}")))?;
        }
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(replay) = &cfg.replay_endpoint {
            let replay = endpoint_for(replay, offset)?;
            let mut router = zeromq::RouterSocket::new();
            router
                .bind(&replay)
                .await
                .map_err(|e| MockError::Io(format!("kv events replay endpoint {replay}: {e}")))?;
            tokio::spawn(serve_replay(router, Arc::clone(&buffer)));
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let connect = (!binds(&cfg.endpoint)).then_some(endpoint);
        tokio::spawn(run_publisher(
            PubTask {
                publ,
                connect,
                buffer,
                topic: Bytes::from(cfg.topic.clone().into_bytes()),
                keep: cfg.buffer_steps.max(1),
                shape,
                rank: data_parallel_rank,
            },
            rx,
        ));
        Ok(Publisher { tx })
    }
}

/// The publishing task's state.
struct PubTask {
    publ: zeromq::PubSocket,
    /// Connect here first (`None`: already bound).
    connect: Option<String>,
    buffer: Buffer,
    topic: Bytes,
    /// Batches kept for replay.
    keep: usize,
    shape: WireShape,
    rank: Option<i64>,
}

async fn run_publisher(task: PubTask, mut rx: mpsc::UnboundedReceiver<Vec<EngineEvent>>) {
    let PubTask {
        mut publ,
        connect,
        buffer,
        topic,
        keep,
        shape,
        rank,
    } = task;
    if let Some(to) = connect {
        // Connecting (to a proxy) waits for the peer; events queue meanwhile.
        if let Err(e) = publ.connect(&to).await {
            tracing::error!("kv events endpoint {to}: {e}");
            return;
        }
    }
    let mut seq: u64 = 0;
    while let Some(events) = rx.recv().await {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut batch = EventBatch::new(ts, events);
        batch.data_parallel_rank = rank;
        let payload = Bytes::from(encode_batch(&batch, shape));
        if let Ok(mut b) = buffer.lock() {
            if b.len() >= keep {
                b.pop_front();
            }
            b.push_back((seq, payload.clone()));
        }
        let mut msg = ZmqMessage::from(topic.clone());
        msg.push_back(Bytes::copy_from_slice(&kvroute_vllm::seq_frame(seq)));
        msg.push_back(payload);
        // A PUB socket drops messages nobody subscribed to; an error here is not fatal.
        let _ = publ.send(msg).await;
        seq += 1;
    }
}

async fn serve_replay(mut router: zeromq::RouterSocket, buffer: Buffer) {
    while let Ok(msg) = router.recv().await {
        let frames: Vec<Bytes> = msg.into_vec();
        // [identity, start] from a DEALER without a delimiter, [identity, "", start] otherwise.
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = kvroute_vllm::parse_seq_frame(start) else {
            continue;
        };
        let replies: Vec<(u64, Bytes)> = buffer
            .lock()
            .map(|b| b.iter().filter(|(s, _)| *s >= start).cloned().collect())
            .unwrap_or_default();
        let frame = |seq: Bytes, payload: Bytes| {
            let mut m = ZmqMessage::from(identity.clone());
            m.push_back(Bytes::new());
            m.push_back(seq);
            m.push_back(payload);
            m
        };
        for (seq, payload) in replies {
            if router
                .send(frame(
                    Bytes::copy_from_slice(&kvroute_vllm::seq_frame(seq)),
                    payload,
                ))
                .await
                .is_err()
            {
                break;
            }
        }
        let _ = router
            .send(frame(
                Bytes::copy_from_slice(&kvroute_vllm::REPLAY_END),
                Bytes::new(),
            ))
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvroute_vllm::{decode_event_batch, BlockRemoved, BlockStored, EngineHash};
    use rmpv::Value;

    #[test]
    fn both_shapes_decode_to_the_same_batch() {
        let mut stored = BlockStored::new(
            vec![EngineHash::Int(5), EngineHash::Int(u64::MAX)],
            Some(EngineHash::Int(4)),
            (0..32).collect(),
            16,
        );
        stored.medium = Some("GPU".into());
        let mut removed = BlockRemoved::new(vec![EngineHash::Int(5)]);
        removed.medium = Some("GPU".into());
        let mut batch = EventBatch::new(
            1.5,
            vec![
                EngineEvent::BlockStored(stored),
                EngineEvent::BlockRemoved(removed),
                EngineEvent::AllBlocksCleared,
            ],
        );
        batch.data_parallel_rank = Some(2);
        for shape in [WireShape::Map, WireShape::Array] {
            let bytes = encode_batch(&batch, shape);
            assert_eq!(decode_event_batch(&bytes).unwrap(), batch, "{shape:?}");
        }
        // The map shape really is maps.
        let v = rmpv::decode::read_value(&mut &encode_batch(&batch, WireShape::Map)[..]).unwrap();
        assert!(matches!(&v[1][0], Value::Map(_)));
        assert_eq!(v[1][0]["type"].as_str(), Some("BlockStored"));
    }

    #[test]
    fn endpoints_offset_by_rank() {
        assert_eq!(
            endpoint_for("tcp://*:5557", 2).unwrap(),
            "tcp://0.0.0.0:5559"
        );
        assert_eq!(
            endpoint_for("tcp://127.0.0.1:6000", 0).unwrap(),
            "tcp://127.0.0.1:6000"
        );
        assert!(endpoint_for("ipc:///tmp/x", 0).is_err());
    }

    #[test]
    fn engine_hashes_are_not_kvblocks() {
        let tokens: Vec<u32> = (0..16).collect();
        let ours = kvblock::BlockHasher::new(kvblock::BlockSize::new(16).unwrap())
            .sequence_hashes(&tokens)[0]
            .get();
        assert_ne!(engine_block_hash(None, &tokens), ours);
        assert_ne!(
            engine_block_hash(None, &tokens),
            engine_block_hash(Some(1), &tokens)
        );
    }
}
