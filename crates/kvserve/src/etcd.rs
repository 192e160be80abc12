//! Worker discovery through etcd: the record an engine registers under a key prefix with a lease,
//! and a minimal client of etcd's v3 JSON gateway (`/v3/kv/range`, `/v3/kv/put`,
//! `/v3/lease/grant`, `/v3/lease/keepalive`) over plain HTTP, so no gRPC stack is needed.
//! `kvmock --etcd-endpoint` registers itself; `kvrouter --discovery-backend etcd` reads them.

use base64::engine::general_purpose::STANDARD as B64;
use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The key prefix workers register under: `kvkit/workers/<host:port>`.
pub const PREFIX: &str = "kvkit/workers/";

/// What a worker registers: where its API and its KV events are, its block size and model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRecord {
    /// The OpenAI API's base URL, e.g. `http://10.0.0.5:30000`.
    pub url: String,
    /// The ZMQ PUB endpoint of its KV events, if it publishes them.
    #[serde(default)]
    pub events: Option<String>,
    /// The ZMQ ROUTER endpoint that replays missed batches, if any.
    #[serde(default)]
    pub replay: Option<String>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The model it serves.
    #[serde(default)]
    pub model: Option<String>,
}

/// A client of one etcd server's JSON gateway.
#[derive(Debug, Clone)]
pub struct Etcd {
    base: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Etcd {
    /// A client of `endpoint` (`host:port` or `http://host:port`).
    pub fn new(endpoint: &str) -> Self {
        let base = if endpoint.starts_with("http://") {
            endpoint.trim_end_matches('/').to_string()
        } else {
            format!("http://{}", endpoint.trim_end_matches('/'))
        };
        Etcd {
            base,
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }

    async fn call(&self, path: &str, body: Value) -> Result<Value, String> {
        let req = hyper::Request::post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let work = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| format!("etcd at {}: {e}", self.base))?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            let v: Value = serde_json::from_slice(&bytes)
                .map_err(|e| format!("etcd at {}: {path} answered non-JSON: {e}", self.base))?;
            if !status.is_success() {
                return Err(format!("etcd at {}: {path}: HTTP {status}: {v}", self.base));
            }
            Ok(v)
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), work)
            .await
            .map_err(|_| format!("etcd at {}: {path} timed out", self.base))?
    }

    /// Grants a lease of `ttl_s` seconds; returns its id.
    pub async fn grant(&self, ttl_s: u64) -> Result<i64, String> {
        let v = self.call("/v3/lease/grant", json!({"TTL": ttl_s})).await?;
        id_of(&v["ID"]).ok_or_else(|| format!("etcd granted no lease id: {v}"))
    }

    /// Keeps a lease alive for another TTL.
    pub async fn keepalive(&self, lease: i64) -> Result<(), String> {
        let v = self
            .call("/v3/lease/keepalive", json!({"ID": lease.to_string()}))
            .await?;
        match v["result"]["TTL"]
            .as_str()
            .and_then(|t| t.parse::<i64>().ok())
        {
            Some(t) if t > 0 => Ok(()),
            _ => Err(format!("lease {lease} is gone: {v}")),
        }
    }

    /// Puts `key` = `value`, tied to `lease` (0: none).
    pub async fn put(&self, key: &str, value: &str, lease: i64) -> Result<(), String> {
        let mut body = json!({"key": B64.encode(key), "value": B64.encode(value)});
        if lease != 0 {
            body["lease"] = Value::from(lease.to_string());
        }
        self.call("/v3/kv/put", body).await.map(|_| ())
    }

    /// Every key under `prefix` with its value, in key order.
    pub async fn range_prefix(&self, prefix: &str) -> Result<Vec<(String, String)>, String> {
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last += 1;
        }
        let v = self
            .call(
                "/v3/kv/range",
                json!({"key": B64.encode(prefix), "range_end": B64.encode(&end)}),
            )
            .await?;
        let text = |x: &Value| {
            x.as_str()
                .and_then(|s| B64.decode(s).ok())
                .map(|b| String::from_utf8_lossy(&b).into_owned())
        };
        Ok(v["kvs"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|kv| Some((text(&kv["key"])?, text(&kv["value"]).unwrap_or_default())))
            .collect())
    }

    /// Registers `record` under `PREFIX + name` with a lease of `ttl_s` seconds and keeps the
    /// lease alive until the returned task is dropped or the process ends (then the key goes
    /// when the lease expires). Re-registers after etcd loses the lease.
    pub async fn register(
        self,
        name: &str,
        record: &WorkerRecord,
        ttl_s: u64,
    ) -> Result<tokio::task::JoinHandle<()>, String> {
        let key = format!("{PREFIX}{name}");
        let value = serde_json::to_string(record).map_err(|e| e.to_string())?;
        let mut lease = self.grant(ttl_s).await?;
        self.put(&key, &value, lease).await?;
        Ok(tokio::spawn(async move {
            let every = std::time::Duration::from_millis((ttl_s * 1000 / 3).max(200));
            loop {
                tokio::time::sleep(every).await;
                if self.keepalive(lease).await.is_ok() {
                    continue;
                }
                // Lost (etcd restarted, or a long pause): register again.
                if let Ok(l) = self.grant(ttl_s).await {
                    if self.put(&key, &value, l).await.is_ok() {
                        lease = l;
                    }
                }
            }
        }))
    }
}

/// etcd's JSON gateway writes 64-bit ids as strings.
fn id_of(v: &Value) -> Option<i64> {
    v.as_str()
        .and_then(|s| s.parse().ok())
        .or_else(|| v.as_i64())
}
