//! Pure helpers of the report and the trace statistics: nearest-rank percentiles, summaries.

use serde::Serialize;

/// The 1-based nearest rank of quantile `q` among `total` samples: `ceil(q * total)`, at least 1.
pub(crate) fn nearest_rank(q: f64, total: u64) -> u64 {
    ((q * total as f64).ceil() as u64).clamp(1, total.max(1))
}

/// `a / b`, or 0 when `b` is not positive.
pub(crate) fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Mean and percentiles of a latency, in milliseconds (nearest-rank percentiles).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
#[non_exhaustive]
pub struct Summary {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

impl Summary {
    /// From `(value_us, weight)` samples.
    pub(crate) fn weighted(samples: &mut [(u64, u64)]) -> Self {
        let total: u64 = samples.iter().map(|s| s.1).sum();
        if total == 0 {
            return Summary::default();
        }
        samples.sort_unstable();
        let sum: f64 = samples.iter().map(|&(v, w)| v as f64 * w as f64).sum();
        let at = |q: f64| {
            // Nearest rank: the smallest value whose cumulative weight reaches the rank.
            let rank = nearest_rank(q, total);
            let mut acc = 0;
            for &(v, w) in samples.iter() {
                acc += w;
                if acc >= rank {
                    return v as f64 / 1e3;
                }
            }
            0.0
        };
        Summary {
            mean: sum / total as f64 / 1e3,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
        }
    }

    /// From values in microseconds, each of weight 1.
    pub(crate) fn from_us(values: impl Iterator<Item = u64>) -> Self {
        // `weighted` with every weight 1, sorting plain values.
        let mut v: Vec<u64> = values.collect();
        if v.is_empty() {
            return Summary::default();
        }
        v.sort_unstable();
        let total = v.len() as u64;
        let sum: f64 = v.iter().map(|&x| x as f64 * 1.0).sum();
        let at = |q: f64| v[nearest_rank(q, total) as usize - 1] as f64 / 1e3;
        Summary {
            mean: sum / total as f64 / 1e3,
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let s = Summary::from_us((1..=100).map(|x| x * 1000));
        assert_eq!((s.p50, s.p90, s.p99, s.mean), (50.0, 90.0, 99.0, 50.5));
        let mut w = vec![(2000, 1), (1000, 3)];
        let s = Summary::weighted(&mut w);
        assert_eq!((s.p50, s.p99, s.mean), (1.0, 2.0, 1.25));
        assert_eq!(Summary::from_us(std::iter::empty()), Summary::default());
        assert_eq!((nearest_rank(0.5, 0), nearest_rank(0.99, 10)), (1, 10));
        // Plain values summarise like weight-1 samples.
        let xs: Vec<u64> = (0..1001u64).map(|i| (i * 7919) % 1013 * 37).collect();
        let mut w: Vec<(u64, u64)> = xs.iter().map(|&x| (x, 1)).collect();
        assert_eq!(Summary::from_us(xs.into_iter()), Summary::weighted(&mut w));
    }
}
