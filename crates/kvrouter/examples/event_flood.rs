//! A stand-in engine that publishes KV-event batches on vLLM's ZMQ wire as fast as it can, to
//! measure what a path of events can carry (for example relay -> JetStream -> router):
//!
//! ```text
//! cargo run --release -p kvrouter --example event_flood -- tcp://127.0.0.1:5557 20000 16
//! ```
//!
//! Arguments: the PUB endpoint to bind, the number of batches, and blocks per batch (each batch
//! is one `BlockStored` continuing one long chain, so every block is new). It waits a second
//! for subscribers to join before the first batch, and prints the time it took to publish.

use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_vllm::{BlockStored, EngineEvent, EngineHash, EventBatch};
use zeromq::{Socket, SocketSend, ZmqMessage};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let endpoint = args.get(1).map_or("tcp://127.0.0.1:5557", String::as_str);
    let batches: u64 = args.get(2).map_or(Ok(20_000), |s| s.parse())?;
    let per: u64 = args.get(3).map_or(Ok(16), |s| s.parse())?;
    let mut publisher = zeromq::PubSocket::new();
    publisher.bind(endpoint).await?;
    // ZMQ's slow joiner: subscribers need a moment after they connect.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    for seq in 0..batches {
        let first = seq * per;
        let hashes = (first..first + per)
            .map(|h| EngineHash::Int(h + 1))
            .collect();
        let parent = (seq > 0).then_some(EngineHash::Int(first));
        let tokens = (0..per * 16).map(|t| (first * 16 + t) as u32).collect();
        let stored = BlockStored::new(hashes, parent, tokens, 16);
        let payload = EventBatch::new(0.0, vec![EngineEvent::BlockStored(stored)]).to_msgpack();
        let mut msg = ZmqMessage::from(Bytes::from_static(b"kv-events"));
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(Bytes::from(payload));
        publisher.send(msg).await?;
    }
    let took = started.elapsed().as_secs_f64();
    println!(
        "published {batches} batches of {per} blocks in {took:.2} s ({:.0} batches/s)",
        batches as f64 / took
    );
    // Keep the socket open while the last messages drain.
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(())
}
