//! Service-level objectives: latency targets per request, their attainment and goodput.

use serde::Serialize;

use crate::error::Error;
use crate::records::RequestRecord;
use crate::stats::ratio;

/// Latency targets a request must meet (`--slo-ttft-ms`, `--slo-itl-ms`, `--slo-e2e-ms`);
/// unset targets are not checked. All are in milliseconds and a request meets a target when
/// its latency is at most the target.
///
/// - **TTFT**: arrival to first token.
/// - **ITL**: the request's *mean* inter-token gap, `(last token - first token) / (output - 1)`.
///   A request of one output token has no gap and meets it. (The mean, not the request's own
///   p99 gap: the simulator does not keep every token's time, and the mean is what a client
///   that counts tokens over a stream sees.)
/// - **E2E**: arrival to last token.
///
/// A rejected request meets no target.
///
/// ```
/// let slo = kvsim::Slo::new(Some(2_000.0), Some(50.0), None);
/// assert!(slo.is_set());
/// assert!(!kvsim::Slo::default().is_set());
/// assert!(kvsim::Slo::new(Some(-1.0), None, None).validate().is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct Slo {
    /// Time to first token at most this (ms).
    pub ttft_ms: Option<f64>,
    /// Mean inter-token gap of the request at most this (ms).
    pub itl_ms: Option<f64>,
    /// Arrival to last token at most this (ms).
    pub e2e_ms: Option<f64>,
}

impl Slo {
    /// Targets in milliseconds; `None` is not checked.
    pub fn new(ttft_ms: Option<f64>, itl_ms: Option<f64>, e2e_ms: Option<f64>) -> Self {
        Slo {
            ttft_ms,
            itl_ms,
            e2e_ms,
        }
    }

    /// Whether any target is set.
    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.itl_ms.is_some() || self.e2e_ms.is_some()
    }

    /// Every set target must be a finite number > 0.
    pub fn validate(&self) -> Result<(), Error> {
        for (setting, v) in [
            ("slo.ttft_ms", self.ttft_ms),
            ("slo.itl_ms", self.itl_ms),
            ("slo.e2e_ms", self.e2e_ms),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(Error::invalid(setting, v, "a finite number of ms > 0"));
                }
            }
        }
        Ok(())
    }

    /// Which targets request `r` meets: (TTFT, ITL, E2E); an unset target is met.
    pub(crate) fn meets(&self, r: &RequestRecord) -> [bool; 3] {
        if r.rejected {
            return [false; 3];
        }
        let within = |us: f64, target: Option<f64>| target.is_none_or(|ms| us <= ms * 1e3);
        let gaps = r.output.saturating_sub(1);
        let itl = if gaps == 0 {
            true
        } else {
            within(
                r.finish.saturating_sub(r.first_token) as f64 / gaps as f64,
                self.itl_ms,
            )
        };
        [
            within(r.first_token.saturating_sub(r.arrival) as f64, self.ttft_ms),
            itl,
            within(r.finish.saturating_sub(r.arrival) as f64, self.e2e_ms),
        ]
    }
}

/// How many requests met the targets. Attainments are shares of *all* requests (rejected
/// ones included, as misses); `null` in JSON for a target not set.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[non_exhaustive]
pub struct SloReport {
    /// The TTFT target (ms).
    pub ttft_ms: Option<f64>,
    /// The ITL target (ms), on each request's mean inter-token gap.
    pub itl_ms: Option<f64>,
    /// The E2E target (ms).
    pub e2e_ms: Option<f64>,
    /// Share of requests within the TTFT target.
    pub ttft_attainment: Option<f64>,
    /// Share of requests within the ITL target.
    pub itl_attainment: Option<f64>,
    /// Share of requests within the E2E target.
    pub e2e_attainment: Option<f64>,
    /// Share of requests within every set target.
    pub attainment: f64,
    /// Requests within every set target.
    pub met: usize,
    /// Requests within every set target per second of makespan.
    pub goodput_rps: f64,
}

impl SloReport {
    /// The attainment of `slo` over `requests`, goodput over `makespan_s`.
    pub(crate) fn build(slo: &Slo, requests: &[RequestRecord], makespan_s: f64) -> Self {
        let mut each = [0usize; 3];
        let mut met = 0;
        for r in requests {
            let m = slo.meets(r);
            for (n, ok) in each.iter_mut().zip(m) {
                *n += usize::from(ok);
            }
            met += usize::from(m.iter().all(|&ok| ok));
        }
        let n = requests.len() as f64;
        let share = |target: Option<f64>, k: usize| target.map(|_| ratio(k as f64, n));
        SloReport {
            ttft_ms: slo.ttft_ms,
            itl_ms: slo.itl_ms,
            e2e_ms: slo.e2e_ms,
            ttft_attainment: share(slo.ttft_ms, each[0]),
            itl_attainment: share(slo.itl_ms, each[1]),
            e2e_attainment: share(slo.e2e_ms, each[2]),
            attainment: ratio(met as f64, n),
            met,
            goodput_rps: ratio(met as f64, makespan_s),
        }
    }

    /// The report's SLO line (with its newline).
    pub(crate) fn to_text(&self) -> String {
        let mut parts = Vec::new();
        for (name, target, att, note) in [
            ("TTFT", self.ttft_ms, self.ttft_attainment, ""),
            (
                "ITL",
                self.itl_ms,
                self.itl_attainment,
                " (mean per request)",
            ),
            ("E2E", self.e2e_ms, self.e2e_attainment, ""),
        ] {
            if let (Some(t), Some(a)) = (target, att) {
                parts.push(format!("{name} <= {t} ms{note} {:.1}%", a * 100.0));
            }
        }
        format!(
            "  SLO attainment: {} | all {:.1}% ({} requests) | goodput {:.2} req/s\n",
            parts.join(", "),
            self.attainment * 100.0,
            self.met,
            self.goodput_rps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(arrival: u64, first: u64, finish: u64, output: usize, rejected: bool) -> RequestRecord {
        RequestRecord {
            arrival,
            input: 100,
            output,
            prompt_blocks: 1,
            engine: 0,
            hits: 0,
            decode_engine: None,
            decode_hits: 0,
            host_hits: 0,
            scheduled: arrival,
            transfer_us: 0,
            first_token: first,
            finish,
            rejected,
            turn: 1,
            preemptions: 0,
        }
    }

    /// Four requests worked by hand against TTFT <= 100 ms, ITL <= 10 ms:
    /// - A: TTFT 100 ms (met, the bound is inclusive), 11 tokens over 100 ms: gap 10 ms (met).
    /// - B: TTFT 150 ms (missed), gap 5 ms (met).
    /// - C: TTFT 50 ms (met), 3 tokens over 30.002 ms: gap 15.001 ms (missed).
    /// - D: rejected: misses both.
    /// - E: TTFT 20 ms (met), one output token: no gap (met).
    ///
    /// TTFT 3/5, ITL 3/5, both 2/5 (A and E); the makespan is 4 s, so goodput is 2 / 4 = 0.5
    /// requests per second.
    #[test]
    fn attainment_and_goodput_by_hand() {
        let rs = [
            rec(0, 100_000, 200_000, 11, false),
            rec(1_000_000, 1_150_000, 1_200_000, 11, false),
            rec(2_000_000, 2_050_000, 2_080_002, 3, false),
            rec(3_000_000, 0, 0, 10, true),
            rec(3_500_000, 3_520_000, 3_520_000, 1, false),
        ];
        let slo = Slo::new(Some(100.0), Some(10.0), None);
        let r = SloReport::build(&slo, &rs, 4.0);
        assert_eq!(r.ttft_attainment, Some(0.6));
        assert_eq!(r.itl_attainment, Some(0.6));
        assert_eq!(r.e2e_attainment, None);
        assert_eq!((r.met, r.attainment, r.goodput_rps), (2, 0.4, 0.5));
        assert_eq!(
            r.to_text(),
            "  SLO attainment: TTFT <= 100 ms 60.0%, ITL <= 10 ms (mean per request) 60.0% | all 40.0% (2 requests) | goodput 0.50 req/s\n"
        );
        // An E2E target of 100 ms keeps C (80.002 ms) and E (20 ms); A and B take 200 ms.
        let slo = Slo::new(None, None, Some(100.0));
        let r = SloReport::build(&slo, &rs, 4.0);
        assert_eq!((r.e2e_attainment, r.met), (Some(0.4), 2));
    }
}
