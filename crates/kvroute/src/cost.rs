//! Every cost formula of the router, in one place: the source document's [`cost`], the
//! [`prefill_aware_cost`] and the `score` that picks between them by [`CostModel`], and what
//! adjusts a choice: busy thresholds, temperature sampling, tier credits. Everything beyond the
//! source document's cost is off by default; the defaults route exactly as it does.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// Which cost the `Kv` policy minimises (see [`RouterBuilder::cost_model`](crate::RouterBuilder::cost_model)).
///
/// ```
/// use kvroute::CostModel;
/// assert_eq!("prefill-aware".parse::<CostModel>()?, CostModel::PrefillAware);
/// assert_eq!(CostModel::default().to_string(), "seed");
/// # Ok::<(), kvroute::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum CostModel {
    /// The source document's [`cost`](crate::cost):
    /// `overlap_weight × (request_blocks − hits) + active_blocks`, where a request still
    /// prefilling weighs like one that decodes.
    #[default]
    Seed,
    /// [`prefill_aware_cost`]: the prefill a worker still owes its earlier requests is weighed
    /// like the prefill this request would add, and only decoding requests count as load.
    PrefillAware,
}

impl CostModel {
    /// Every cost model, in the order of the CLI's accepted values.
    pub const ALL: [CostModel; 2] = [CostModel::Seed, CostModel::PrefillAware];

    /// The model's name as the CLI spells it.
    pub fn name(self) -> &'static str {
        match self {
            CostModel::Seed => "seed",
            CostModel::PrefillAware => "prefill-aware",
        }
    }
}

impl fmt::Display for CostModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CostModel {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        CostModel::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| Error::UnknownCostModel { got: s.to_string() })
    }
}

/// The prefill-aware cost of a worker:
/// `overlap_weight × (pending_prefill_blocks + request_blocks − cache_hits) + decode_blocks`.
///
/// `pending_prefill_blocks` are the uncached prompt blocks of the worker's requests that have not
/// produced their first token yet; `decode_blocks` the distinct prompt blocks of its requests
/// past their first token. Prefill is where a request's time to first token goes, so the prefill
/// queue a worker already has counts with the same weight as the prefill this request would add;
/// the source document's [`cost`](crate::cost) counts it once, like decode load.
///
/// The blocks are added as floats, which is exact for any sum below 2^53.
///
/// ```
/// use kvroute::{cost, prefill_aware_cost};
/// // W0 holds 8 of the 10 blocks but still prefills 30 uncached blocks of an earlier request;
/// // W1 holds nothing and decodes 20 blocks. With overlap weight 2:
/// assert_eq!(cost(2.0, 10, 8, 30), 34.0); // the seed's cost prefers W0 (34 < 40) ...
/// assert_eq!(cost(2.0, 10, 0, 20), 40.0);
/// assert_eq!(prefill_aware_cost(2.0, 10, 8, 30, 0), 64.0); // ... which must first prefill 32 blocks
/// assert_eq!(prefill_aware_cost(2.0, 10, 0, 0, 20), 40.0); // W1 wins
/// ```
#[inline]
pub fn prefill_aware_cost(
    overlap_weight: f64,
    request_blocks: usize,
    cache_hits: usize,
    pending_prefill_blocks: usize,
    decode_blocks: usize,
) -> f64 {
    let (pending, decode) = (pending_prefill_blocks as f64, decode_blocks as f64);
    prefill_aware(
        overlap_weight,
        missing(request_blocks, cache_hits),
        pending,
        decode,
    )
}

/// The blocks of a request of `request_blocks` that a worker with `cache_hits` lacks, as a
/// float (what both costs weigh by the overlap weight).
#[inline]
pub(crate) fn missing(request_blocks: usize, cache_hits: usize) -> f64 {
    request_blocks.saturating_sub(cache_hits) as f64
}

/// [`cost`] from the blocks missing and the active blocks as floats: the router keeps its
/// workers' loads as floats too, so that its scan converts nothing per worker but the
/// blocks missing.
#[inline]
pub(crate) fn seed(overlap_weight: f64, missing: f64, active: f64) -> f64 {
    overlap_weight * missing + active
}

/// [`prefill_aware_cost`] from floats, as [`seed`] is [`cost`]. The pending and missing blocks
/// add as floats: exactly their sum for any count below 2^53.
#[inline]
pub(crate) fn prefill_aware(overlap_weight: f64, missing: f64, pending: f64, decode: f64) -> f64 {
    overlap_weight * (pending + missing) + decode
}

/// When a worker is too busy to take a request (see
/// [`RouterBuilder::busy_threshold`](crate::RouterBuilder::busy_threshold)): its decode blocks
/// exceed a fraction of its capacity, or its pending prefill exceeds a token budget. The `Kv`
/// policy skips busy workers unless every worker is busy; then it takes the least loaded one.
///
/// A worker whose engine reports its own load
/// ([`Router::set_reported_load`](crate::Router::set_reported_load)) is also busy when its
/// reported KV-cache usage exceeds the decode fraction, or (with
/// [`waiting_requests`](Self::waiting_requests)) when it reports more waiting requests than
/// allowed. Without reports, only the router's own counts decide.
///
/// ```
/// use kvroute::BusyThreshold;
/// let t = BusyThreshold::new().decode_fraction(0.9, 4_000).prefill_tokens(16_384);
/// assert_eq!(t.decode_limit(), Some((0.9, 4_000)));
/// assert_eq!(t.prefill_limit(), Some(16_384));
/// assert_eq!(t.waiting_limit(), None);
/// assert_eq!(t.waiting_requests(4).waiting_limit(), Some(4));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[must_use]
pub struct BusyThreshold {
    decode: Option<(f64, usize)>,
    prefill_tokens: Option<usize>,
    waiting: Option<usize>,
}

impl BusyThreshold {
    /// No limit yet: nobody is busy.
    pub fn new() -> Self {
        Self::default()
    }

    /// Busy when a worker's decode blocks exceed `fraction × capacity_blocks`.
    pub fn decode_fraction(mut self, fraction: f64, capacity_blocks: usize) -> Self {
        self.decode = Some((fraction, capacity_blocks));
        self
    }

    /// Busy when a worker's pending prefill exceeds `tokens` (its pending prefill blocks times
    /// the router's block size).
    pub fn prefill_tokens(mut self, tokens: usize) -> Self {
        self.prefill_tokens = Some(tokens);
        self
    }

    /// Busy when a worker's engine reports more than `requests` waiting (queued) requests
    /// ([`Router::set_reported_load`](crate::Router::set_reported_load)); a worker without a
    /// report is never busy by this limit.
    pub fn waiting_requests(mut self, requests: usize) -> Self {
        self.waiting = Some(requests);
        self
    }

    /// The reported waiting-requests limit.
    pub fn waiting_limit(&self) -> Option<usize> {
        self.waiting
    }

    /// The decode limit: (fraction, capacity in blocks).
    pub fn decode_limit(&self) -> Option<(f64, usize)> {
        self.decode
    }

    /// The pending-prefill budget, in tokens.
    pub fn prefill_limit(&self) -> Option<usize> {
        self.prefill_tokens
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if let Some((f, cap)) = self.decode {
            if !(f.is_finite() && f > 0.0) {
                return Err(Error::InvalidWeight {
                    name: "busy decode fraction",
                    value: f,
                });
            }
            if cap == 0 {
                return Err(Error::InvalidSetting {
                    name: "busy capacity blocks",
                    value: 0,
                    expected: "at least 1",
                });
            }
        }
        Ok(())
    }

    /// The limits as integers, for a router of `block_size` tokens per block: by its own
    /// counts, a worker is busy exactly when its decode blocks exceed the first or its pending
    /// prefill blocks exceed the second (what [`is_busy`](Self::is_busy) says of the counts,
    /// without a float per worker; what its engine reports is [`reported_busy`](Self::reported_busy)).
    #[inline]
    pub(crate) fn limits(&self, block_size: usize) -> (usize, usize) {
        // `d as f64 > x` for a whole `d` and `x >= 0` is `d > floor(x)` (a float to integer
        // cast floors and saturates; NaN, which validation rejects, would read 0).
        let decode = self
            .decode
            .map_or(usize::MAX, |(f, cap)| (f * cap as f64) as usize);
        // `p × block_size > t` (saturating) is `p > t / block_size`, but never for t = MAX.
        let prefill = self.prefill_tokens.map_or(usize::MAX, |t| {
            if t == usize::MAX {
                usize::MAX
            } else {
                t / block_size.max(1)
            }
        });
        (decode, prefill)
    }

    /// Whether a worker with this load is busy: the router's counts, and what its engine
    /// reports (`kv_usage` 0 and `waiting` 0 without a report, which never count as busy).
    #[inline]
    pub(crate) fn is_busy(
        &self,
        decode_blocks: usize,
        pending_prefill_tokens: usize,
        kv_usage: f64,
        waiting: usize,
    ) -> bool {
        self.decode
            .is_some_and(|(f, cap)| decode_blocks as f64 > f * cap as f64)
            || self
                .prefill_tokens
                .is_some_and(|t| pending_prefill_tokens > t)
            || self.reported_busy(kv_usage, waiting)
    }

    /// Whether what an engine reports makes it busy: a KV usage above the decode fraction, or
    /// more waiting requests than the waiting limit.
    #[inline]
    pub(crate) fn reported_busy(&self, kv_usage: f64, waiting: usize) -> bool {
        self.decode.is_some_and(|(f, _)| kv_usage > f) || self.waiting.is_some_and(|n| waiting > n)
    }
}

/// What a hit on a lower tier is worth against one on the device (see
/// [`RouterBuilder::tier_credits`](crate::RouterBuilder::tier_credits)): a block the worker
/// holds only in host memory or on disk saves its recompute but must be loaded back, so it
/// counts as `credit` of a hit in the cost:
/// `W × (request_blocks − device_hits − Σ credit(tier of each lower-tier hit)) + load`.
///
/// Defaults: host 0.75, disk 0.25. Loading a block of an 8B model (128 KiB per token) over a
/// 25 GB/s host link takes about a quarter of recomputing it on an H100-class GPU (19.5 µs per
/// token); a 5 GB/s disk takes longer than the recompute, but frees the GPU for others.
///
/// ```
/// use kvroute::TierCredits;
/// let c = TierCredits::default();
/// assert_eq!((c.host(), c.disk()), (0.75, 0.25));
/// let none = TierCredits::new(0.0, 0.0); // lower tiers ignored
/// assert_eq!(none.host(), 0.0);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TierCredits {
    host: f64,
    disk: f64,
}

impl Default for TierCredits {
    fn default() -> Self {
        TierCredits {
            host: 0.75,
            disk: 0.25,
        }
    }
}

impl TierCredits {
    /// A host hit counts `host` of a device hit, a disk hit `disk` (each in 0..=1).
    pub fn new(host: f64, disk: f64) -> Self {
        TierCredits { host, disk }
    }

    /// The host tier's credit.
    pub fn host(&self) -> f64 {
        self.host
    }

    /// The disk tier's credit.
    pub fn disk(&self) -> f64 {
        self.disk
    }

    /// The credit of `tier` (the device's is 1).
    pub fn of(&self, tier: kvcache::Tier) -> f64 {
        match tier {
            kvcache::Tier::Host => self.host,
            kvcache::Tier::Disk => self.disk,
            _ => 1.0,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        for (name, v) in [
            ("host tier credit", self.host),
            ("disk tier credit", self.disk),
        ] {
            if !(v.is_finite() && (0.0..=1.0).contains(&v)) {
                return Err(Error::InvalidWeight { name, value: v });
            }
        }
        Ok(())
    }
}

/// Samples index `k` of `costs` with probability ∝ `exp(−(costs[k] − min) / (t × (max − min)))`,
/// `u` uniform in [0, 1): at temperature 1 the worst candidate is `e` times less likely than the
/// best. `None` when the spread is zero or not finite (the caller breaks the tie as at
/// temperature 0). The costs are overwritten with their weights.
pub(crate) fn sample_softmax(costs: &mut [f64], t: f64, u: f64) -> Option<usize> {
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let scale = t * (max - min);
    if !(scale.is_finite() && scale > 0.0) {
        return None;
    }
    let mut total = 0.0;
    for c in costs.iter_mut() {
        *c = (-(*c - min) / scale).exp();
        total += *c;
    }
    let mut left = u * total;
    for (k, &w) in costs.iter().enumerate() {
        left -= w;
        if left < 0.0 {
            return Some(k);
        }
    }
    // Rounding left a sliver past the last weight: the last candidate.
    Some(costs.len() - 1)
}

/// The routing cost of a worker: `overlap_weight * (request_blocks - cache_hits) + active_blocks`.
///
/// Lower is better. `request_blocks - cache_hits` is what the worker would have to prefill from
/// scratch; `active_blocks` is its in-flight load. A weight of 0 is pure load balance; a large
/// weight is pure locality. `cache_hits` above `request_blocks` counts as a full hit.
///
/// ```
/// // The source document's worked example: W0 (8 hits, 6 active) beats W1 (0 hits, 1 active).
/// assert_eq!(kvroute::cost(1.0, 10, 8, 6), 8.0);
/// assert_eq!(kvroute::cost(1.0, 10, 0, 1), 11.0);
/// ```
#[inline]
pub fn cost(
    overlap_weight: f64,
    request_blocks: usize,
    cache_hits: usize,
    active_blocks: usize,
) -> f64 {
    seed(
        overlap_weight,
        missing(request_blocks, cache_hits),
        active_blocks as f64,
    )
}

/// A worker's cost under `model`, from the blocks it lacks and its load as floats: `active`
/// blocks, and `queued`, its pending prefill and decode blocks.
#[inline]
pub(crate) fn score(
    model: CostModel,
    weight: f64,
    missing: f64,
    active: f64,
    queued: [f64; 2],
) -> f64 {
    match model {
        CostModel::Seed => seed(weight, missing, active),
        CostModel::PrefillAware => prefill_aware(weight, missing, queued[0], queued[1]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Counts of blocks up to 2^52, with the edges.
    fn blocks() -> impl Strategy<Value = usize> {
        prop_oneof![0usize..1_000, 0usize..(1 << 52), Just(1 << 52)]
    }

    proptest! {
        /// The costs from floats are the costs as integers define them: the prefill-aware sum
        /// added as integers, then converted; the seed's term by term.
        #[test]
        fn float_costs_are_the_integer_formulas(
            weight in prop_oneof![Just(0.0), Just(1.0), 0.0f64..1e6],
            n in blocks(),
            hits in blocks(),
            pending in blocks(),
            decode in blocks(),
            active in blocks(),
        ) {
            let lacking = n.saturating_sub(hits);
            let want = weight * (pending + lacking) as f64 + decode as f64;
            let got = prefill_aware_cost(weight, n, hits, pending, decode);
            prop_assert_eq!(got.to_bits(), want.to_bits());
            let queued = [pending as f64, decode as f64];
            let scored = score(CostModel::PrefillAware, weight, missing(n, hits), 0.0, queued);
            prop_assert_eq!(scored.to_bits(), want.to_bits());
            let want = weight * lacking as f64 + active as f64;
            prop_assert_eq!(cost(weight, n, hits, active).to_bits(), want.to_bits());
            let scored = score(CostModel::Seed, weight, missing(n, hits), active as f64, [0.0; 2]);
            prop_assert_eq!(scored.to_bits(), want.to_bits());
        }
    }

    #[test]
    fn softmax_follows_its_formula() {
        // Costs 0 and 1 at t = 1: weights 1 and 1/e, so P(first) = e / (e + 1) = 0.7311.
        let p0 = std::f64::consts::E / (std::f64::consts::E + 1.0);
        assert_eq!(sample_softmax(&mut [0.0, 1.0], 1.0, p0 - 1e-9), Some(0));
        assert_eq!(sample_softmax(&mut [0.0, 1.0], 1.0, p0 + 1e-9), Some(1));
        assert_eq!(sample_softmax(&mut [5.0, 5.0], 1.0, 0.5), None);
        assert_eq!(sample_softmax(&mut [0.0, f64::INFINITY], 1.0, 0.5), None);
        assert_eq!(sample_softmax(&mut [0.0, 1.0], 0.0, 0.5), None);
        // The scale is the spread: costs 10 and 20 sample like 0 and 1.
        assert_eq!(sample_softmax(&mut [10.0, 20.0], 1.0, p0 + 1e-9), Some(1));
        assert_eq!(sample_softmax(&mut [0.0, 1.0], 1.0, 1.0 - 1e-17), Some(1));
    }

    #[test]
    fn integer_limits_agree_with_is_busy() {
        for (f, cap) in [
            (0.5, 100),
            (0.9, 512),
            (0.3, 7),
            (1.0, 1),
            (2.5, 3),
            (1e30, 5),
        ] {
            for tokens in [0, 1, 15, 16, 17, 64, 1 << 16, usize::MAX - 1, usize::MAX] {
                let t = BusyThreshold::new()
                    .decode_fraction(f, cap)
                    .prefill_tokens(tokens);
                for bs in [1, 3, 16, 512] {
                    let (d, p) = t.limits(bs);
                    for decode in [0, 1, 2, 3, 49, 50, 51, 460, 461, 1000] {
                        for pending in [0, 1, 2, 4, 5, 1 << 12, usize::MAX / 2, usize::MAX] {
                            let tokens = pending.saturating_mul(bs);
                            assert_eq!(
                                decode > d || pending > p,
                                t.is_busy(decode, tokens, 0.0, 0),
                                "{f} {cap} {tokens} {bs}: decode {decode}, pending {pending}"
                            );
                        }
                    }
                }
            }
        }
        assert_eq!(BusyThreshold::new().limits(16), (usize::MAX, usize::MAX));
    }

    #[test]
    fn busy_limits_are_strict() {
        let t = BusyThreshold::new()
            .decode_fraction(0.5, 100)
            .prefill_tokens(64);
        assert!(!t.is_busy(50, 64, 0.5, usize::MAX));
        assert!(t.is_busy(51, 0, 0.0, 0));
        assert!(t.is_busy(0, 65, 0.0, 0));
        // A reported KV usage above the decode fraction.
        assert!(t.is_busy(0, 0, 0.51, 0));
        let w = BusyThreshold::new().waiting_requests(3);
        assert!(!w.is_busy(usize::MAX, usize::MAX, 1.0, 3));
        assert!(w.is_busy(0, 0, 0.0, 4));
        assert!(!BusyThreshold::new().is_busy(usize::MAX, usize::MAX, 1.0, usize::MAX));
        assert!(BusyThreshold::new()
            .decode_fraction(0.0, 1)
            .validate()
            .is_err());
        assert!(BusyThreshold::new()
            .decode_fraction(1.0, 0)
            .validate()
            .is_err());
        assert!(BusyThreshold::new()
            .decode_fraction(f64::NAN, 1)
            .validate()
            .is_err());
    }
}
