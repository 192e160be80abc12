//! Waiting until an instant on time (the engine emulator's steps and `kvload`'s arrivals). A timed sleep here wakes 100 to 300 µs late (timer slack,
//! a virtual machine's wake-up), and `--speedup 10` makes that up to 3 ms of emulated time on
//! every token or arrival; so a waiter sleeps until shortly before the instant and then polls.
//! The poll yields the CPU but keeps it busy: a thread whose deadlines come less than 200 µs
//! apart (an engine at `--speedup 100` or more, `kvload` above 5,000 requests/s) uses a core.

use std::time::{Duration, Instant};

/// How long before the instant a waiter stops sleeping and polls instead.
const POLL: Duration = Duration::from_micros(200);

/// Asks Linux for the finest timer slack on the calling thread (by default a sleep may end
/// 50 µs late); elsewhere a no-op. Call it once on a thread that waits with this module.
///
/// ```
/// use std::time::{Duration, Instant};
/// use kvserve::clock::{precise_timers, sleep_until};
///
/// precise_timers();
/// let deadline = Instant::now() + Duration::from_micros(500);
/// sleep_until(deadline);
/// assert!(Instant::now() >= deadline);
/// ```
pub fn precise_timers() {
    // A failure only leaves the default slack.
    #[cfg(target_os = "linux")]
    let _ = nix::sys::prctl::set_timerslack(1);
}

/// How long to sleep before polling for `deadline` (zero: poll now).
pub fn sleep_part(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .saturating_sub(POLL)
}

/// Polls `ready` until it returns `Some` or `deadline` passes (then `None`), yielding the CPU
/// between polls.
pub fn poll_until<T>(deadline: Instant, mut ready: impl FnMut() -> Option<T>) -> Option<T> {
    loop {
        if let Some(v) = ready() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::yield_now();
    }
}

/// Blocks the calling thread until `deadline`, on time.
pub fn sleep_until(deadline: Instant) {
    std::thread::sleep(sleep_part(deadline));
    poll_until(deadline, || None::<()>);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_wakes_early() {
        precise_timers();
        for us in [0, 50, 300, 2_000] {
            let deadline = Instant::now() + Duration::from_micros(us);
            sleep_until(deadline);
            assert!(Instant::now() >= deadline);
        }
    }

    #[test]
    fn poll_returns_what_is_ready_before_the_deadline() {
        let far = Instant::now() + Duration::from_secs(60);
        let mut n = 0;
        assert_eq!(
            poll_until(far, || {
                n += 1;
                (n == 3).then_some(n)
            }),
            Some(3)
        );
        assert_eq!(poll_until(Instant::now(), || None::<u8>), None);
    }
}
