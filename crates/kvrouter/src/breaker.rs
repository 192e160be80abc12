//! A worker's circuit breaker: it opens after `--breaker-failures` failures (a refused
//! connection, a 5xx, a timeout or a broken exchange before the first byte) within
//! `--breaker-window-s`, keeps the worker out of routing for `--breaker-cooldown-s`, then lets
//! requests through half-open: the next success closes it, the next failure opens it again.
//! Times are the server's clock (time since it started), so the logic is tested without sleeps.

use std::collections::VecDeque;
use std::time::Duration;

/// The breaker's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    /// Failures within `window` that open it (0: never opens).
    pub failures: usize,
    /// How far back failures count.
    pub window: Duration,
    /// How long it stays open before letting requests through again.
    pub cooldown: Duration,
}

/// Where a breaker is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Requests flow.
    Closed,
    /// The worker is out of routing until this time.
    Open {
        /// When requests may try it again.
        until: Duration,
    },
    /// Requests flow; the next outcome decides.
    HalfOpen,
}

impl State {
    /// Its name in `/v1/admin/workers` (and its value in `/metrics`: 0, 1, 2).
    pub fn name(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open { .. } => "open",
            State::HalfOpen => "half-open",
        }
    }

    /// 0 closed, 1 open, 2 half-open.
    pub fn gauge(self) -> u8 {
        match self {
            State::Closed => 0,
            State::Open { .. } => 1,
            State::HalfOpen => 2,
        }
    }
}

/// One worker's breaker.
#[derive(Debug, Clone)]
pub struct Breaker {
    cfg: BreakerConfig,
    /// Failure times within the window, oldest first.
    recent: VecDeque<Duration>,
    state: State,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(cfg: BreakerConfig) -> Self {
        Breaker {
            cfg,
            recent: VecDeque::new(),
            state: State::Closed,
        }
    }

    /// Where it is.
    pub fn state(&self) -> State {
        self.state
    }

    /// Whether the worker is kept out of routing.
    pub fn is_open(&self) -> bool {
        matches!(self.state, State::Open { .. })
    }

    /// A failure at `now`; true when it opened the breaker.
    pub fn failure(&mut self, now: Duration) -> bool {
        if self.cfg.failures == 0 {
            return false;
        }
        let open = State::Open {
            until: now + self.cfg.cooldown,
        };
        match self.state {
            State::HalfOpen => {
                self.state = open;
                self.recent.clear();
                true
            }
            State::Open { .. } => false,
            State::Closed => {
                self.recent.push_back(now);
                while self
                    .recent
                    .front()
                    .is_some_and(|&t| now.saturating_sub(t) > self.cfg.window)
                {
                    self.recent.pop_front();
                }
                if self.recent.len() >= self.cfg.failures {
                    self.state = open;
                    self.recent.clear();
                    return true;
                }
                false
            }
        }
    }

    /// A success: a half-open breaker closes.
    pub fn success(&mut self) {
        if self.state == State::HalfOpen {
            self.state = State::Closed;
        }
    }

    /// Time passes: an open breaker whose cooldown is over goes half-open (true then).
    pub fn tick(&mut self, now: Duration) -> bool {
        match self.state {
            State::Open { until } if now >= until => {
                self.state = State::HalfOpen;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const S: Duration = Duration::from_secs(1);

    fn cfg(failures: usize) -> BreakerConfig {
        BreakerConfig {
            failures,
            window: 10 * S,
            cooldown: 5 * S,
        }
    }

    #[test]
    fn opens_on_enough_failures_in_the_window_probes_and_closes() {
        let mut b = Breaker::new(cfg(3));
        assert!(!b.failure(Duration::ZERO));
        assert!(!b.failure(5 * S));
        // The first failure has left the window: still two.
        assert!(!b.failure(11 * S));
        assert!(b.failure(12 * S));
        assert_eq!(b.state(), State::Open { until: 17 * S });
        assert!(!b.tick(16 * S));
        assert!(b.tick(17 * S));
        assert_eq!(b.state(), State::HalfOpen);
        // A failed probe opens it again at once.
        assert!(b.failure(18 * S));
        assert!(b.tick(23 * S));
        b.success();
        assert_eq!(b.state(), State::Closed);
        // Closed afresh: the old failures do not count.
        assert!(!b.failure(24 * S));
    }

    #[test]
    fn zero_failures_never_opens() {
        let mut b = Breaker::new(cfg(0));
        for t in 0..100 {
            assert!(!b.failure(t * S));
        }
        assert_eq!(b.state(), State::Closed);
    }

    /// What happens to a breaker, in time order.
    #[derive(Debug, Clone)]
    enum Op {
        Failure(u64),
        Success,
        Tick(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4_000).prop_map(Op::Failure),
            Just(Op::Success),
            (0u64..4_000).prop_map(Op::Tick),
        ]
    }

    proptest! {
        /// Against a naive model that keeps every failure since the breaker last closed or
        /// opened and counts those within the window.
        #[test]
        fn agrees_with_a_naive_model(n in 1usize..5, ops in prop::collection::vec(op(), 0..60)) {
            let c = BreakerConfig { failures: n, window: Duration::from_millis(1_000), cooldown: Duration::from_millis(500) };
            let mut b = Breaker::new(c);
            let (mut now, mut all): (u64, Vec<u64>) = (0, Vec::new());
            let mut model = State::Closed;
            for op in ops {
                match op {
                    Op::Failure(dt) => {
                        now += dt;
                        let t = Duration::from_millis(now);
                        let opened = b.failure(t);
                        let want = match model {
                            State::HalfOpen => { all.clear(); model = State::Open { until: t + c.cooldown }; true }
                            State::Open { .. } => false,
                            State::Closed => {
                                all.push(now);
                                let within = all.iter().filter(|&&f| now - f <= 1_000).count();
                                if within >= n { all.clear(); model = State::Open { until: t + c.cooldown }; true } else { false }
                            }
                        };
                        prop_assert_eq!(opened, want);
                    }
                    Op::Success => {
                        b.success();
                        if model == State::HalfOpen { model = State::Closed; }
                    }
                    Op::Tick(dt) => {
                        now += dt;
                        let t = Duration::from_millis(now);
                        let half = b.tick(t);
                        let want = matches!(model, State::Open { until } if t >= until);
                        if want { model = State::HalfOpen; }
                        prop_assert_eq!(half, want);
                    }
                }
                prop_assert_eq!(b.state(), model);
            }
        }
    }
}
