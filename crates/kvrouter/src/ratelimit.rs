//! `--rate-limit RPS[,BURST]`: a token bucket per API key (the `Authorization: Bearer KEY`
//! header; requests without one share one bucket), checked before admission. A request past
//! its key's bucket gets 429 with OpenAI's error object and `Retry-After`, the whole seconds
//! until the bucket holds a token again (at least 1).
//!
//! Each bucket is kept as the one instant its next token would be due once every earlier
//! request had its token (the generic cell rate algorithm: the same answers as a bucket
//! refilled continuously, in one integer per key, no floating point). Time is nanoseconds
//! since the server started; a bucket holds `BURST` tokens and gains one every `1 / RPS`
//! seconds. A bucket that is full again is the same as none, so buckets are dropped once full
//! ([`Buckets::prune`], run lazily as new keys arrive): memory follows the keys seen within
//! the last `BURST / RPS` seconds, not every key ever seen.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::state::Server;

/// `--rate-limit RPS[,BURST]`: `RPS` tokens a second, buckets of `BURST` tokens (default
/// `max(1, ceil(RPS))`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    rps: f64,
    burst: u64,
}

impl RateLimit {
    /// `rps` tokens a second (finite, above 0), buckets of `burst` (at least 1) tokens.
    pub fn new(rps: f64, burst: u64) -> Result<Self, String> {
        if !(rps.is_finite() && rps > 0.0 && rps <= 1e9) {
            return Err(format!(
                "expected a rate above 0 and at most 1e9 requests a second, got {rps}"
            ));
        }
        if burst == 0 {
            return Err("expected a burst of at least 1 request".into());
        }
        Ok(RateLimit { rps, burst })
    }

    /// Tokens a second.
    pub fn rps(&self) -> f64 {
        self.rps
    }

    /// Tokens a full bucket holds.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// Nanoseconds between two tokens (at least 1).
    fn interval_ns(&self) -> u64 {
        ((1e9 / self.rps).round() as u64).max(1)
    }
}

impl FromStr for RateLimit {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("expected RPS or RPS,BURST (e.g. 10 or 2.5,20), got {s:?}");
        let (rps, burst) = match s.split_once(',') {
            Some((r, b)) => (r, Some(b)),
            None => (s, None),
        };
        let rps: f64 = rps.trim().parse().map_err(|_| bad())?;
        let burst = match burst {
            Some(b) => b.trim().parse().map_err(|_| bad())?,
            None if rps.is_finite() => (rps.ceil() as u64).max(1),
            None => 1,
        };
        RateLimit::new(rps, burst).map_err(|e| format!("{s:?}: {e}"))
    }
}

/// The buckets of every API key seen lately. Every call takes `now` (time since some fixed
/// start, never going back by more than a request's own jitter), so tests control the clock.
#[derive(Debug)]
pub struct Buckets {
    /// Nanoseconds per token.
    interval: u64,
    /// Nanoseconds a full bucket stands for: `burst × interval`.
    capacity: u64,
    /// By key: when (nanoseconds) the bucket is full again. Absent: full.
    full_at: HashMap<String, u64>,
    /// Prune before adding a key once this many are held.
    prune_at: usize,
}

/// Buckets held before the first lazy prune.
const PRUNE_FIRST_AT: usize = 1024;

impl Buckets {
    /// Empty (every bucket full) for `limit`.
    pub fn new(limit: RateLimit) -> Self {
        let interval = limit.interval_ns();
        Buckets {
            interval,
            capacity: interval.saturating_mul(limit.burst),
            full_at: HashMap::new(),
            prune_at: PRUNE_FIRST_AT,
        }
    }

    /// Takes a token from `key`'s bucket at `now`: `Ok`, or `Err` with how long until the
    /// bucket holds one (nothing is taken then).
    pub fn take(&mut self, key: &str, now: Duration) -> Result<(), Duration> {
        let now = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        let full_at = self.full_at.get(key).copied().unwrap_or(0).max(now);
        let next = full_at.saturating_add(self.interval);
        // `next - now` is what the bucket lacks to be full after this token.
        if next - now > self.capacity {
            return Err(Duration::from_nanos(next - self.capacity - now));
        }
        match self.full_at.get_mut(key) {
            Some(t) => *t = next,
            None => {
                if self.full_at.len() >= self.prune_at {
                    self.prune(Duration::from_nanos(now));
                    self.prune_at = (2 * self.full_at.len()).max(PRUNE_FIRST_AT);
                }
                self.full_at.insert(key.to_string(), next);
            }
        }
        Ok(())
    }

    /// Drops the buckets full again at `now`: the same as absent ones.
    pub fn prune(&mut self, now: Duration) {
        let now = u64::try_from(now.as_nanos()).unwrap_or(u64::MAX);
        self.full_at.retain(|_, &mut t| t > now);
    }

    /// Buckets held (keys not full at the last prune, or seen since).
    pub fn len(&self) -> usize {
        self.full_at.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.full_at.is_empty()
    }
}

/// The API key of a request: the token of its `Authorization: Bearer KEY` header, else the
/// whole header, else the empty key every such request shares.
pub fn api_key(headers: &HeaderMap) -> &str {
    let Some(v) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return "";
    };
    let v = v.trim();
    match v.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case("bearer ") => v[7..].trim(),
        _ => v,
    }
}

/// The whole seconds of `Retry-After` for a wait: rounded up, at least 1.
pub fn retry_after_secs(wait: Duration) -> u64 {
    wait.as_nanos().div_ceil(1_000_000_000).max(1) as u64
}

/// The server's limiter: [`Buckets`] behind a lock, or nothing without `--rate-limit`.
#[derive(Debug)]
pub struct Limiter(Mutex<Buckets>);

impl Limiter {
    /// A limiter for `limit`.
    pub fn new(limit: RateLimit) -> Self {
        Limiter(Mutex::new(Buckets::new(limit)))
    }

    /// [`Buckets::take`] under the lock.
    pub fn take(&self, key: &str, now: Duration) -> Result<(), Duration> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take(key, now)
    }

    /// [`Buckets::len`] under the lock.
    pub fn len(&self) -> usize {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether no bucket is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The middleware: a completion request past its key's bucket gets 429 before anything else
/// is done for it (its body is not even read).
pub(crate) async fn limit(State(server): State<Arc<Server>>, req: Request, next: Next) -> Response {
    let Some(limiter) = &server.rate_limiter else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    let limited = req.method() == Method::POST
        && (path == "/v1/completions" || path == "/v1/chat/completions");
    if limited {
        let now = server.started.elapsed();
        if let Err(wait) = limiter.take(api_key(req.headers()), now) {
            server.counters.rate_limited.fetch_add(1, Ordering::Relaxed);
            return too_many(&server, wait);
        }
    }
    next.run(req).await
}

fn too_many(server: &Server, wait: Duration) -> Response {
    let secs = retry_after_secs(wait);
    let limit = server.cfg.rate_limit.map_or(0.0, |l| l.rps());
    let body = kvserve::openai::error_body(
        StatusCode::TOO_MANY_REQUESTS.as_u16(),
        "RateLimitError",
        &format!(
            "this API key is over --rate-limit {limit} requests a second: try again in {secs} s"
        ),
    );
    let mut resp = (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response();
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn flags_parse_with_the_default_burst() {
        let l: RateLimit = "10".parse().unwrap();
        assert_eq!((l.rps(), l.burst()), (10.0, 10));
        let l: RateLimit = "2.5".parse().unwrap();
        assert_eq!(l.burst(), 3);
        let l: RateLimit = "0.2".parse().unwrap();
        assert_eq!(l.burst(), 1);
        let l: RateLimit = "5, 20".parse().unwrap();
        assert_eq!((l.rps(), l.burst()), (5.0, 20));
        for bad in ["", "0", "-1", "x", "5,0", "5,x", "inf", "NaN", "1,2,3"] {
            assert!(bad.parse::<RateLimit>().is_err(), "{bad:?} parsed");
        }
        assert!("5,0".parse::<RateLimit>().unwrap_err().contains("burst"));
    }

    #[test]
    fn a_burst_then_one_token_per_interval() {
        let mut b = Buckets::new(RateLimit::new(2.0, 3).unwrap());
        for _ in 0..3 {
            assert_eq!(b.take("k", ms(0)), Ok(()));
        }
        // Empty: the next token comes in 500 ms.
        assert_eq!(b.take("k", ms(0)), Err(ms(500)));
        assert_eq!(b.take("k", ms(200)), Err(ms(300)));
        assert_eq!(b.take("k", ms(500)), Ok(()));
        assert_eq!(b.take("k", ms(500)), Err(ms(500)));
        // Other keys have their own buckets.
        assert_eq!(b.take("other", ms(500)), Ok(()));
        assert_eq!(b.take("", ms(500)), Ok(()));
        // Refilled, but never past the burst.
        for _ in 0..3 {
            assert_eq!(b.take("k", ms(60_000)), Ok(()));
        }
        assert!(b.take("k", ms(60_000)).is_err());
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(ms(1)), 1);
        assert_eq!(retry_after_secs(ms(1000)), 1);
        assert_eq!(retry_after_secs(ms(1001)), 2);
        let mut b = Buckets::new(RateLimit::new(0.1, 1).unwrap());
        assert_eq!(b.take("k", ms(0)), Ok(()));
        assert_eq!(b.take("k", ms(500)).map_err(retry_after_secs), Err(10));
    }

    #[test]
    fn api_keys_come_from_the_bearer_token() {
        let mut h = HeaderMap::new();
        assert_eq!(api_key(&h), "");
        h.insert(header::AUTHORIZATION, "Bearer sk-1".parse().unwrap());
        assert_eq!(api_key(&h), "sk-1");
        h.insert(header::AUTHORIZATION, "bearer  sk-2 ".parse().unwrap());
        assert_eq!(api_key(&h), "sk-2");
        h.insert(header::AUTHORIZATION, "Basic dXNlcg==".parse().unwrap());
        assert_eq!(api_key(&h), "Basic dXNlcg==");
    }

    #[test]
    fn full_buckets_are_dropped_so_many_keys_stay_bounded() {
        let mut b = Buckets::new(RateLimit::new(1000.0, 1).unwrap());
        // A million keys, one request each, 1 µs apart: each bucket is full again 1 ms later.
        for i in 0..1_000_000u64 {
            b.take(&i.to_string(), Duration::from_micros(i)).unwrap();
        }
        assert!(b.len() <= 2 * PRUNE_FIRST_AT, "{} buckets held", b.len());
        b.prune(Duration::from_secs(10));
        assert!(b.is_empty());
    }

    /// The naive model: a bucket of credit (nanoseconds of tokens) refilled continuously,
    /// created full, one key at a time; never pruned.
    #[derive(Default)]
    struct Naive {
        buckets: HashMap<u8, (u64, u64)>,
    }

    impl Naive {
        fn take(&mut self, key: u8, now: u64, interval: u64, capacity: u64) -> Result<(), u64> {
            let (credit, last) = self.buckets.entry(key).or_insert((capacity, now));
            *credit = (*credit + (now - *last)).min(capacity);
            *last = now;
            if *credit >= interval {
                *credit -= interval;
                Ok(())
            } else {
                Err(interval - *credit)
            }
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Take(u8),
        Advance(u64),
        Prune,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..4).prop_map(Op::Take),
            3 => prop_oneof![0u64..2_000, 0u64..3_000_000_000].prop_map(Op::Advance),
            1 => Just(Op::Prune),
        ]
    }

    proptest! {
        #[test]
        fn buckets_answer_as_the_naive_model(
            rps in prop_oneof![0.1f64..10.0, 1.0f64..1e6],
            burst in 1u64..8,
            ops in prop::collection::vec(op(), 1..300),
        ) {
            let limit = RateLimit::new(rps, burst).unwrap();
            let (interval, capacity) = (limit.interval_ns(), limit.interval_ns() * burst);
            let mut b = Buckets::new(limit);
            let mut naive = Naive::default();
            let mut now = 0u64;
            for op in ops {
                match op {
                    Op::Take(k) => {
                        let got = b.take(&k.to_string(), Duration::from_nanos(now));
                        let want = naive.take(k, now, interval, capacity).map_err(Duration::from_nanos);
                        prop_assert_eq!(got, want, "key {} at {} ns", k, now);
                    }
                    Op::Advance(d) => now += d,
                    Op::Prune => {
                        b.prune(Duration::from_nanos(now));
                        // Only buckets not yet full are held.
                        for (k, (credit, last)) in &naive.buckets {
                            let full = (credit + (now - last)).min(capacity) == capacity;
                            prop_assert_eq!(b.full_at.contains_key(&k.to_string()), !full);
                        }
                    }
                }
            }
        }
    }
}
