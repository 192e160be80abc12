//! `kvkit.Router`: kvroute's router and kvroute-vllm's event ingestion behind one mutex, with
//! workers named by strings.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvblock::{BlockHash, BlockSize, ExtraKeys};
use kvcache::{KvEvent, WorkerId};
use kvroute::{
    BusyThreshold, CostModel, Policy, RequestId, Role, RouterBuilder, Salt, TierCredits,
};
use kvroute_vllm::{IngestSummary, MirrorSnapshot, VllmIngest};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use serde::{Deserialize, Serialize};

use crate::errors::Error;
use crate::hasher;

/// The format name and version of `Router.snapshot()`'s bytes.
const SNAPSHOT_FORMAT: &str = "kvkit-py/router-snapshot";
const SNAPSHOT_VERSION: u32 = 1;

/// What the mutex guards: the router, its vLLM ingestion, and the worker names.
struct Inner {
    router: kvroute::Router,
    ingest: VllmIngest,
    ids: BTreeMap<String, WorkerId>,
    names: HashMap<WorkerId, Arc<str>>,
    next_id: u64,
}

impl Inner {
    fn id(&self, name: &str) -> Result<WorkerId, Error> {
        self.ids
            .get(name)
            .copied()
            .ok_or_else(|| Error::UnknownWorker(name.to_string()))
    }

    fn candidate(&self, c: &kvroute::Candidate) -> Candidate {
        Candidate {
            worker: self.name(c.worker),
            cache_hits: c.cache_hits,
            active_blocks: c.active_blocks,
            pending_prefill_blocks: c.pending_prefill_blocks,
            decode_blocks: c.decode_blocks,
            busy: c.busy,
            lower_tier_hits: c.lower_tier_hits,
            cost: c.cost,
        }
    }

    /// A worker's name (shared: a decision clones a reference, not the string).
    fn name(&self, id: WorkerId) -> Arc<str> {
        self.names
            .get(&id)
            .cloned()
            .unwrap_or_else(|| Arc::from(id.get().to_string()))
    }
}

/// `Router.snapshot()`'s document: the mirror (index and vLLM feeds) and the worker names.
#[derive(Serialize, Deserialize)]
struct Snapshot {
    format: String,
    version: u32,
    workers: Vec<(String, u64)>,
    next_id: u64,
    mirror: MirrorSnapshot,
}

/// How a request is hashed: salt, namespace and per-block extra keys.
struct Keys {
    salt: Salt,
    keys: Vec<ExtraKeys>,
    plain: bool,
}

impl Keys {
    fn new(
        salt: Option<String>,
        namespace: Option<String>,
        cache_salt: Option<String>,
        extra_keys: Option<&Bound<'_, PyAny>>,
    ) -> Result<Self, Error> {
        let mut keys = extra_keys
            .map(hasher::extra_keys)
            .transpose()?
            .unwrap_or_default();
        if let Some(s) = cache_salt.filter(|s| !s.is_empty()) {
            // vLLM keys the first block with the cache salt, after its multimodal items.
            if keys.is_empty() {
                keys.push(ExtraKeys::new());
            }
            keys[0].push_str(&s);
        }
        let plain = salt.as_deref().is_none_or(str::is_empty)
            && namespace.as_deref().is_none_or(str::is_empty)
            && keys.iter().all(ExtraKeys::is_empty);
        let salt = Salt::lora(salt.unwrap_or_default()).namespace(namespace.unwrap_or_default());
        Ok(Keys { salt, keys, plain })
    }

    fn blocks(&self, size: BlockSize, tokens: &[u32]) -> Vec<BlockHash> {
        self.salt.block_hashes(size, tokens, &self.keys)
    }
}

fn role(s: &str) -> Result<Role, Error> {
    match s {
        "unified" => Ok(Role::Unified),
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        _ => Err(Error::RouteArgument {
            name: "role",
            value: format!("{s:?}"),
            expected: "\"unified\", \"prefill\" or \"decode\"",
        }),
    }
}

fn seconds(name: &'static str, s: f64) -> Result<Duration, Error> {
    Duration::try_from_secs_f64(s).map_err(|_| Error::RouteArgument {
        name,
        value: s.to_string(),
        expected: "a finite number of seconds >= 0",
    })
}

/// One worker's score for a request (see `Router.explain`).
#[pyclass(frozen, module = "kvkit")]
#[derive(Debug, Clone)]
pub struct Candidate {
    worker: Arc<str>,
    cache_hits: usize,
    active_blocks: usize,
    pending_prefill_blocks: usize,
    decode_blocks: usize,
    busy: bool,
    lower_tier_hits: usize,
    cost: f64,
}

#[pymethods]
impl Candidate {
    /// The worker's name.
    #[getter]
    fn worker(&self) -> &str {
        &self.worker
    }
    /// The leading run of the request's blocks the router believes it holds.
    #[getter]
    fn cache_hits(&self) -> usize {
        self.cache_hits
    }
    /// Its distinct in-flight prompt blocks.
    #[getter]
    fn active_blocks(&self) -> usize {
        self.active_blocks
    }
    /// The uncached prompt blocks of its requests not past their first token.
    #[getter]
    fn pending_prefill_blocks(&self) -> usize {
        self.pending_prefill_blocks
    }
    /// The distinct prompt blocks of its requests past their first token.
    #[getter]
    fn decode_blocks(&self) -> usize {
        self.decode_blocks
    }
    /// Whether the busy threshold counts it busy.
    #[getter]
    fn busy(&self) -> bool {
        self.busy
    }
    /// Blocks after `cache_hits` it holds on a lower tier (host memory, disk).
    #[getter]
    fn lower_tier_hits(&self) -> usize {
        self.lower_tier_hits
    }
    /// Its cost under the router's cost model (lowest wins).
    #[getter]
    fn cost(&self) -> f64 {
        self.cost
    }
    fn __repr__(&self) -> String {
        format!(
            "Candidate(worker={:?}, cache_hits={}, active_blocks={}, cost={:?})",
            self.worker, self.cache_hits, self.active_blocks, self.cost
        )
    }
}

/// Where a request was routed.
#[pyclass(frozen, module = "kvkit")]
#[derive(Debug, Clone)]
pub struct Decision {
    worker: Arc<str>,
    cache_hits: usize,
    cost: f64,
    request_blocks: usize,
    lower_tier_hits: usize,
    candidates: Option<Vec<Candidate>>,
}

#[pymethods]
impl Decision {
    /// The chosen worker's name.
    #[getter]
    fn worker(&self) -> &str {
        &self.worker
    }
    /// The leading run of the request's blocks the chosen worker holds, as the router sees it.
    #[getter]
    fn cache_hits(&self) -> usize {
        self.cache_hits
    }
    /// The chosen worker's cost: overlap_weight * (request_blocks - cache_hits) + active blocks
    /// under the default cost model.
    #[getter]
    fn cost(&self) -> f64 {
        self.cost
    }
    /// The request's full blocks.
    #[getter]
    fn request_blocks(&self) -> usize {
        self.request_blocks
    }
    /// Blocks after `cache_hits` the worker holds on a lower tier.
    #[getter]
    fn lower_tier_hits(&self) -> usize {
        self.lower_tier_hits
    }
    /// Every worker's score before the request was routed, in worker order, when routed with
    /// `explain=True`; otherwise None.
    #[getter]
    fn candidates(&self) -> Option<Vec<Candidate>> {
        self.candidates.clone()
    }
    fn __repr__(&self) -> String {
        format!(
            "Decision(worker={:?}, cache_hits={}, cost={:?}, request_blocks={})",
            self.worker, self.cache_hits, self.cost, self.request_blocks
        )
    }
}

/// A KV-cache-aware router: a mirror of every worker's KV cache (fed by the engines' KV
/// events), in-flight load per worker, and a policy. Safe to share between threads: calls are
/// serialised by a mutex inside, and the GIL is released while the router works.
///
/// The routing model's options are those of kvroute's RouterBuilder: `policy` (kv,
/// prefix_aware, round_robin, random), `overlap_weight` (and per role `prefill_overlap_weight`,
/// `decode_overlap_weight`), `seed` (ties), `prefix_blocks` and `virtual_nodes`
/// (prefix_aware), `cost_model` (seed or prefill-aware), `temperature` (0: lowest cost; > 0:
/// softmax sampling), `busy_decode_fraction` with `busy_capacity_blocks` and/or
/// `busy_prefill_tokens` (skip busy workers), `predicted_ttl_s` (count routed blocks as hits
/// until events confirm them; lapses by `set_clock`), `host_hit_credit` and `disk_hit_credit`
/// (lower tiers), `tail_first_evictions` (trust engines to evict tail first).
#[pyclass(frozen, module = "kvkit")]
pub struct Router {
    builder: RouterBuilder,
    block_size: BlockSize,
    policy: Policy,
    inner: Mutex<Inner>,
}

impl Router {
    fn lock(&self) -> Result<MutexGuard<'_, Inner>, Error> {
        self.inner.lock().map_err(|_| Error::Poisoned)
    }

    /// Runs `f` on the router with the GIL released.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Inner) -> Result<T, Error> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut g = self.lock()?;
            f(&mut g)
        })
        .map_err(Into::into)
    }

    /// A clone of the Rust router (for the overhead bench).
    pub(crate) fn clone_router(&self) -> Result<kvroute::Router, Error> {
        Ok(self.lock()?.router.clone())
    }
}

fn summary<'py>(py: Python<'py>, s: &IngestSummary) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("seq", s.seq)?;
    d.set_item("events", s.events)?;
    d.set_item("events_applied", s.events_applied)?;
    d.set_item("blocks_stored", s.blocks_stored)?;
    d.set_item("already_present", s.already_present)?;
    d.set_item("blocks_removed", s.blocks_removed)?;
    d.set_item("blocks_cleared", s.blocks_cleared)?;
    d.set_item("unknown_removals", s.unknown_removals)?;
    d.set_item("unknown_parents", s.unknown_parents)?;
    d.set_item("gap", s.gap)?;
    d.set_item("restarted", s.restarted)?;
    d.set_item("untracked_blocks", s.untracked_blocks)?;
    Ok(d)
}

#[pymethods]
impl Router {
    /// A router with no workers. `block_size` must equal the engines' --block-size.
    #[new]
    #[pyo3(signature = (
        block_size = 16,
        policy = "kv",
        overlap_weight = 1.0,
        *,
        prefill_overlap_weight = None,
        decode_overlap_weight = None,
        seed = 0,
        prefix_blocks = 1,
        virtual_nodes = 128,
        cost_model = "seed",
        temperature = 0.0,
        busy_decode_fraction = None,
        busy_capacity_blocks = None,
        busy_prefill_tokens = None,
        predicted_ttl_s = 0.0,
        host_hit_credit = None,
        disk_hit_credit = None,
        tail_first_evictions = false,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        block_size: i64,
        policy: &str,
        overlap_weight: f64,
        prefill_overlap_weight: Option<f64>,
        decode_overlap_weight: Option<f64>,
        seed: u64,
        prefix_blocks: usize,
        virtual_nodes: usize,
        cost_model: &str,
        temperature: f64,
        busy_decode_fraction: Option<f64>,
        busy_capacity_blocks: Option<usize>,
        busy_prefill_tokens: Option<usize>,
        predicted_ttl_s: f64,
        host_hit_credit: Option<f64>,
        disk_hit_credit: Option<f64>,
        tail_first_evictions: bool,
    ) -> PyResult<Self> {
        let size = hasher::block_size(block_size)?;
        let policy = policy.parse::<Policy>().map_err(Error::from)?;
        let mut b = kvroute::Router::builder()
            .block_size(size)
            .policy(policy)
            .overlap_weight(overlap_weight)
            .seed(seed)
            .prefix_blocks(prefix_blocks)
            .virtual_nodes(virtual_nodes)
            .cost_model(cost_model.parse::<CostModel>().map_err(Error::from)?)
            .temperature(temperature)
            .predicted_ttl(seconds("predicted_ttl_s", predicted_ttl_s)?)
            .tail_first_evictions(tail_first_evictions);
        if let Some(w) = prefill_overlap_weight {
            b = b.prefill_overlap_weight(w);
        }
        if let Some(w) = decode_overlap_weight {
            b = b.decode_overlap_weight(w);
        }
        if busy_decode_fraction.is_some() || busy_prefill_tokens.is_some() {
            let mut t = BusyThreshold::new();
            if let Some(f) = busy_decode_fraction {
                let cap = busy_capacity_blocks.ok_or(Error::RouteArgument {
                    name: "busy_capacity_blocks",
                    value: "None".into(),
                    expected: "the workers' KV capacity in blocks when busy_decode_fraction is set",
                })?;
                t = t.decode_fraction(f, cap);
            }
            if let Some(n) = busy_prefill_tokens {
                t = t.prefill_tokens(n);
            }
            b = b.busy_threshold(t);
        }
        if host_hit_credit.is_some() || disk_hit_credit.is_some() {
            let d = TierCredits::default();
            b = b.tier_credits(TierCredits::new(
                host_hit_credit.unwrap_or(d.host()),
                disk_hit_credit.unwrap_or(d.disk()),
            ));
        }
        let router = b.clone().build().map_err(Error::from)?;
        Ok(Router {
            builder: b,
            block_size: size,
            policy,
            inner: Mutex::new(Inner {
                router,
                ingest: VllmIngest::new(),
                ids: BTreeMap::new(),
                names: HashMap::new(),
                next_id: 0,
            }),
        })
    }

    /// Tokens per block.
    #[getter]
    fn block_size(&self) -> usize {
        self.block_size.get()
    }

    /// Registers a worker by name (any string, e.g. "10.0.0.7:8000"). False if it was already
    /// registered.
    fn add_worker(&self, py: Python<'_>, name: String) -> PyResult<bool> {
        self.with(py, move |g| {
            if g.ids.contains_key(&name) {
                return Ok(false);
            }
            let id = WorkerId::new(g.next_id);
            g.next_id += 1;
            g.router.add_worker(id);
            g.names.insert(id, Arc::from(name.as_str()));
            g.ids.insert(name, id);
            Ok(true)
        })
    }

    /// Removes a worker, its mirror and its load. False if it was not registered.
    fn remove_worker(&self, py: Python<'_>, name: String) -> PyResult<bool> {
        self.with(py, move |g| {
            let Some(id) = g.ids.remove(&name) else {
                return Ok(false);
            };
            g.names.remove(&id);
            g.ingest.forget_worker(id);
            Ok(g.router.remove_worker(id))
        })
    }

    /// The registered workers' names, in the order they were added.
    fn workers(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        self.with(py, |g| {
            Ok(g.router
                .workers()
                .into_iter()
                .map(|w| g.name(w).to_string())
                .collect())
        })
    }

    /// Applies the MessagePack payload of one ZMQ message of `worker`'s KV-event publisher, as
    /// vLLM or SGLang publish it (an EventBatch), with its sequence number (None: the next one
    /// expected). Returns what was applied (a dict of counts). Raises EventError for a
    /// malformed batch (nothing is applied then).
    #[pyo3(signature = (worker, payload, seq = None))]
    fn apply_vllm_batch<'py>(
        &self,
        py: Python<'py>,
        worker: String,
        payload: &[u8],
        seq: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |g| {
            let id = g.id(&worker)?;
            let Inner { router, ingest, .. } = g;
            Ok(ingest.apply_payload(router, id, seq, payload)?)
        })?;
        summary(py, &s)
    }

    /// Applies one ZMQ multipart message `[topic, seq (8 bytes big-endian), payload]` of
    /// `worker`'s publisher.
    fn apply_vllm_message<'py>(
        &self,
        py: Python<'py>,
        worker: String,
        frames: Vec<Vec<u8>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = self.with(py, |g| {
            let id = g.id(&worker)?;
            let Inner { router, ingest, .. } = g;
            Ok(ingest.apply_multipart(router, id, &frames)?)
        })?;
        summary(py, &s)
    }

    /// Applies one KV event of our own (for engines that do not speak vLLM's wire): `kind` is
    /// "stored" (`blocks` are sequence hashes from BlockHasher.hash, `parent` the hash of the
    /// block before them, if any), "removed" (`blocks`) or "cleared". `event_id` counts each
    /// worker's events from 0: a gap is applied and reported (`gap`: expected and got ids, the
    /// worker is then possibly stale), an id already seen or a parent the worker does not hold
    /// raises EventError. Returns what was applied (a dict of counts).
    #[pyo3(signature = (worker, event_id, kind, blocks = None, parent = None))]
    fn apply_event<'py>(
        &self,
        py: Python<'py>,
        worker: String,
        event_id: u64,
        kind: String,
        blocks: Option<Vec<u64>>,
        parent: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let hashes = |b: Option<Vec<u64>>| -> Vec<BlockHash> {
            b.unwrap_or_default()
                .into_iter()
                .map(BlockHash::new)
                .collect()
        };
        let event = match kind.as_str() {
            "stored" => KvEvent::Stored {
                parent: parent.map(BlockHash::new),
                blocks: hashes(blocks),
            },
            "removed" if parent.is_none() => KvEvent::Removed {
                blocks: hashes(blocks),
            },
            "cleared" if parent.is_none() && blocks.is_none() => KvEvent::Cleared,
            "removed" | "cleared" => {
                return Err(Error::Event(format!(
                    "a {kind:?} event takes {}",
                    if kind == "removed" {
                        "blocks and no parent"
                    } else {
                        "no blocks and no parent"
                    }
                ))
                .into())
            }
            _ => {
                return Err(Error::Event(format!(
                    "unknown kind {kind:?}: expected \"stored\", \"removed\" or \"cleared\""
                ))
                .into())
            }
        };
        let a = self.with(py, |g| {
            let id = g.id(&worker)?;
            g.router
                .apply_event(id, event_id, &event)
                .map_err(Error::EventRejected)
        })?;
        let d = PyDict::new(py);
        d.set_item("gap", a.gap)?;
        d.set_item("stored", a.stored)?;
        d.set_item("already_present", a.already_present)?;
        d.set_item("removed", a.removed)?;
        d.set_item("unknown_removed", a.unknown_removed)?;
        Ok(d)
    }

    /// Routes request `request_id` (an int, unique among requests in flight) with its prompt's
    /// token ids (a list of ints, an `array.array("I")` or bytes of native-endian 4-byte ids)
    /// and records it in flight on the chosen worker until `finish`. `salt` is the
    /// LoRA adapter's name, `namespace` a cache namespace, `cache_salt` vLLM's request field
    /// (keys the first block), `extra_keys` each block's extra keys; `role` is "unified",
    /// "prefill" or "decode" (per-role weights). With `explain=True` the decision carries every
    /// worker's score.
    #[pyo3(signature = (
        request_id, token_ids, salt = None, *, namespace = None, cache_salt = None,
        extra_keys = None, role = "unified", explain = false
    ))]
    #[allow(clippy::too_many_arguments)]
    fn route(
        &self,
        py: Python<'_>,
        request_id: u64,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<String>,
        namespace: Option<String>,
        cache_salt: Option<String>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        role: &str,
        explain: bool,
    ) -> PyResult<Decision> {
        let tokens = hasher::tokens(token_ids)?;
        let role = self::role(role)?;
        let keys = Keys::new(salt, namespace, cache_salt, extra_keys)?;
        let id = RequestId::new(request_id);
        let size = self.block_size;
        self.with(py, move |g| {
            let candidates = if explain {
                let blocks = keys.blocks(size, &tokens);
                let c = g.router.explain(&blocks, role);
                Some(c)
            } else {
                None
            };
            let d = if keys.plain {
                g.router.route_tokens(id, &tokens, role)?
            } else if keys.keys.is_empty() {
                g.router
                    .route_tokens_salted(id, &tokens, &keys.salt, role)?
            } else {
                g.router
                    .route_tokens_keyed(id, &tokens, &keys.salt, &keys.keys, role)?
            };
            Ok(Decision {
                worker: g.name(d.worker),
                cache_hits: d.cache_hits,
                cost: d.cost,
                request_blocks: d.request_blocks,
                lower_tier_hits: d.lower_tier_hits,
                candidates: candidates.map(|cs| cs.iter().map(|c| g.candidate(c)).collect()),
            })
        })
    }

    /// Every worker's hits, load and cost for a prompt, without routing it.
    #[pyo3(signature = (
        token_ids, salt = None, *, namespace = None, cache_salt = None, extra_keys = None,
        role = "unified"
    ))]
    #[allow(clippy::too_many_arguments)]
    fn explain(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        salt: Option<String>,
        namespace: Option<String>,
        cache_salt: Option<String>,
        extra_keys: Option<&Bound<'_, PyAny>>,
        role: &str,
    ) -> PyResult<Vec<Candidate>> {
        let tokens = hasher::tokens(token_ids)?;
        let role = self::role(role)?;
        let keys = Keys::new(salt, namespace, cache_salt, extra_keys)?;
        let size = self.block_size;
        self.with(py, move |g| {
            let blocks = keys.blocks(size, &tokens);
            Ok(g.router
                .explain(&blocks, role)
                .iter()
                .map(|c| g.candidate(c))
                .collect())
        })
    }

    /// Moves a request past its first token (its uncached blocks leave its worker's pending
    /// prefill). A second call is a no-op; RouteError if it is not in flight.
    fn prefill_done(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        self.with(py, |g| {
            Ok(g.router.prefill_done(RequestId::new(request_id))?)
        })
    }

    /// Marks a request finished, releasing its in-flight blocks. RouteError if it is not in
    /// flight.
    fn finish(&self, py: Python<'_>, request_id: u64) -> PyResult<()> {
        self.with(py, |g| Ok(g.router.finish(RequestId::new(request_id))?))
    }

    /// How many blocks the router believes `worker` holds (its cache view).
    fn cache_view(&self, py: Python<'_>, worker: String) -> PyResult<usize> {
        self.with(py, |g| Ok(g.router.cache_view(g.id(&worker)?)))
    }

    /// `worker`'s distinct in-flight prompt blocks (its load in the cost).
    fn active_blocks(&self, py: Python<'_>, worker: String) -> PyResult<usize> {
        self.with(py, |g| Ok(g.router.active_blocks(g.id(&worker)?)))
    }

    /// Requests in flight on `worker`.
    fn in_flight(&self, py: Python<'_>, worker: String) -> PyResult<usize> {
        self.with(py, |g| Ok(g.router.in_flight(g.id(&worker)?)))
    }

    /// Sets the router's clock, in seconds since any fixed start (predicted blocks lapse by it).
    fn set_clock(&self, py: Python<'_>, seconds: f64) -> PyResult<()> {
        let now = self::seconds("seconds", seconds)?;
        self.with(py, |g| {
            g.router.set_clock(now);
            Ok(())
        })
    }

    /// The router's mirror (every worker's blocks and event positions, the vLLM feeds) and
    /// worker names as bytes (JSON), for `restore` in a restarted router. In-flight requests
    /// are not part of it.
    fn snapshot<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let bytes = self.with(py, |g| {
            let doc = Snapshot {
                format: SNAPSHOT_FORMAT.to_string(),
                version: SNAPSHOT_VERSION,
                workers: g.ids.iter().map(|(n, id)| (n.clone(), id.get())).collect(),
                next_id: g.next_id,
                mirror: g.ingest.snapshot(&g.router),
            };
            serde_json::to_vec(&doc).map_err(|e| Error::Snapshot(e.to_string()))
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    /// Makes this router the one `snapshot` saved: its workers and their mirrors (the routing
    /// options stay this router's; the block sizes must be equal). In-flight requests are
    /// forgotten. Raises SnapshotError for bytes that are not such a snapshot.
    fn restore(&self, py: Python<'_>, data: &[u8]) -> PyResult<()> {
        self.with(py, |g| {
            let doc: Snapshot =
                serde_json::from_slice(data).map_err(|e| Error::Snapshot(e.to_string()))?;
            if doc.format != SNAPSHOT_FORMAT || doc.version != SNAPSHOT_VERSION {
                return Err(Error::Snapshot(format!(
                    "format {:?} version {}: expected {SNAPSHOT_FORMAT:?} version {SNAPSHOT_VERSION}",
                    doc.format, doc.version
                )));
            }
            let mut ids = BTreeMap::new();
            let mut names = HashMap::new();
            for (name, id) in doc.workers {
                if id >= doc.next_id
                    || names
                        .insert(WorkerId::new(id), Arc::from(name.as_str()))
                        .is_some()
                {
                    return Err(Error::Snapshot(format!("worker {name:?} has a bad id {id}")));
                }
                if ids.insert(name.clone(), WorkerId::new(id)).is_some() {
                    return Err(Error::Snapshot(format!("worker {name:?} listed twice")));
                }
            }
            let mut router = self.builder.clone().build()?;
            let ingest = VllmIngest::restore(&mut router, doc.mirror)
                .map_err(|e| Error::Snapshot(e.to_string()))?;
            if let Some(w) = router.workers().into_iter().find(|w| !names.contains_key(w)) {
                return Err(Error::Snapshot(format!("{w} has no name")));
            }
            for &id in ids.values() {
                router.add_worker(id);
            }
            *g = Inner {
                router,
                ingest,
                ids,
                names,
                next_id: doc.next_id,
            };
            Ok(())
        })
    }

    fn __repr__(&self) -> String {
        let workers = self.lock().map_or(0, |g| g.ids.len());
        format!(
            "Router(block_size={}, policy={:?}, workers={workers})",
            self.block_size.get(),
            self.policy.name()
        )
    }
}
