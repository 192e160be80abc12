//! A Prometheus histogram of durations, lock-free: counts per bucket, a sum and a count,
//! written as `_bucket{le}`, `_sum` and `_count` in seconds.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// Durations observed in microseconds against fixed upper bounds.
#[derive(Debug)]
pub struct Histogram {
    bounds_us: &'static [u64],
    /// Per bucket, then the overflow.
    counts: Box<[AtomicU64]>,
    sum_us: AtomicU64,
}

impl Histogram {
    /// An empty histogram with these bucket upper bounds (microseconds, ascending).
    pub fn new(bounds_us: &'static [u64]) -> Self {
        Histogram {
            bounds_us,
            counts: (0..=bounds_us.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
        }
    }

    /// Counts one duration.
    pub fn observe(&self, us: u64) {
        let k = self.bounds_us.partition_point(|&b| b < us);
        self.counts[k].fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    /// Appends the histogram in Prometheus text as `name` (in seconds).
    pub fn write(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (k, &b) in self.bounds_us.iter().enumerate() {
            cumulative += self.counts[k].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{}\"}} {cumulative}",
                b as f64 / 1e6
            );
        }
        cumulative += self.counts[self.bounds_us.len()].load(Ordering::Relaxed);
        let sum = self.sum_us.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {cumulative}\n{name}_sum {sum}\n{name}_count {cumulative}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounds_inclusive() {
        let h = Histogram::new(&[10, 100]);
        for us in [0, 10, 11, 100, 101, 5_000] {
            h.observe(us);
        }
        let mut out = String::new();
        h.write(&mut out, "x_seconds", "X.");
        assert_eq!(
            out,
            "# HELP x_seconds X.\n# TYPE x_seconds histogram\n\
             x_seconds_bucket{le=\"0.00001\"} 2\nx_seconds_bucket{le=\"0.0001\"} 4\n\
             x_seconds_bucket{le=\"+Inf\"} 6\nx_seconds_sum 0.005222\nx_seconds_count 6\n"
        );
    }
}
