//! Session affinity: a multi-turn session's requests kept on the worker that served its last
//! turn, where its context is cached.

use std::collections::VecDeque;
use std::str::FromStr;
use std::time::Duration;

use kvcache::WorkerId;

use crate::{Error, Map};

/// A session (a conversation, an agent's run) whose turns should share a worker. Make one from
/// the client's session header with [`SessionId::from_name`]; the simulator numbers its own.
///
/// ```
/// use kvroute::SessionId;
/// assert_eq!(SessionId::from_name("chat-42"), SessionId::from_name("chat-42"));
/// assert_ne!(SessionId::from_name("chat-42"), SessionId::from_name("chat-43"));
/// assert_eq!(SessionId::new(7).get(), 7);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct SessionId(u64);

impl SessionId {
    /// A session numbered `id`.
    pub const fn new(id: u64) -> Self {
        SessionId(id)
    }

    /// The session a name stands for (an `x-session-id` header): XXH3-64 of its UTF-8 bytes,
    /// the same in every replica and every version.
    pub fn from_name(name: &str) -> Self {
        SessionId(xxhash_rust::xxh3::xxh3_64(name.as_bytes()))
    }

    /// Its number.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl std::fmt::Display for SessionId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "session {:016x}", self.0)
    }
}

/// How a session's turns are routed (see
/// [`RouterBuilder::session_affinity`](crate::RouterBuilder::session_affinity)).
///
/// ```
/// use kvroute::SessionAffinity;
/// assert_eq!("hard".parse::<SessionAffinity>()?, SessionAffinity::Hard);
/// assert_eq!(SessionAffinity::default(), SessionAffinity::Soft);
/// assert!("sticky".parse::<SessionAffinity>().is_err());
/// # Ok::<(), kvroute::Error>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SessionAffinity {
    /// Sessions are ignored: every turn is routed on its own.
    Off,
    /// A turn goes to the worker of the session's last turn unless that worker is not routable
    /// (down, draining, removed) or busy (the router's busy threshold); then it is routed as
    /// any request and the session moves to the worker chosen.
    #[default]
    Soft,
    /// A turn always goes to the worker of the session's last turn; when that worker is not
    /// routable, routing fails with [`Error::SessionUnavailable`].
    Hard,
}

impl FromStr for SessionAffinity {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        match s {
            "off" => Ok(SessionAffinity::Off),
            "soft" => Ok(SessionAffinity::Soft),
            "hard" => Ok(SessionAffinity::Hard),
            _ => Err(Error::UnknownSessionAffinity { got: s.to_string() }),
        }
    }
}

impl std::fmt::Display for SessionAffinity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            SessionAffinity::Off => "off",
            SessionAffinity::Soft => "soft",
            SessionAffinity::Hard => "hard",
        })
    }
}

/// Each live session's worker and when it was last used; a session unused for the TTL is
/// forgotten. Memory is bounded by the sessions used within one TTL.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sessions {
    ttl: Duration,
    /// Worker and last use, by session.
    live: Map<SessionId, (WorkerId, Duration)>,
    /// Uses in time order: (when, session). A session used again has a later entry; its
    /// earlier ones are skipped when they come out.
    uses: VecDeque<(Duration, SessionId)>,
}

impl Sessions {
    pub(crate) fn new(ttl: Duration) -> Self {
        Sessions {
            ttl,
            ..Sessions::default()
        }
    }

    /// The worker of `session`'s last use, unless it lapsed by `now`.
    pub(crate) fn worker(&mut self, session: SessionId, now: Duration) -> Option<WorkerId> {
        self.expire(now);
        self.live.get(&session).map(|&(w, _)| w)
    }

    /// `session` used at `now` on `worker`. A use older than the session's last one (another
    /// replica's, delivered late) changes nothing.
    pub(crate) fn record(&mut self, session: SessionId, worker: WorkerId, now: Duration) {
        if self.ttl.is_zero() {
            return;
        }
        if self.live.get(&session).is_some_and(|&(_, last)| last > now) {
            return;
        }
        self.live.insert(session, (worker, now));
        // Uses arrive in time order from this router's clock; a late one from another replica
        // goes in its place, so that the queue stays sorted.
        let at = self.uses.partition_point(|&(t, _)| t <= now);
        self.uses.insert(at, (now, session));
    }

    /// Forgets the sessions unused since `now - ttl`.
    pub(crate) fn expire(&mut self, now: Duration) {
        while let Some(&(t, s)) = self.uses.front() {
            if t.saturating_add(self.ttl) > now {
                break;
            }
            self.uses.pop_front();
            if self.live.get(&s).is_some_and(|&(_, last)| last == t) {
                self.live.remove(&s);
            }
        }
    }

    /// Live sessions.
    pub(crate) fn len(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    proptest! {
        /// Against a naive model: every session's last use, looked up by scanning.
        #[test]
        fn matches_a_naive_table(ops in proptest::collection::vec((0u64..6, 0u64..4, 0u64..50, any::<bool>()), 1..200)) {
            let ttl = Duration::from_secs(20);
            let mut s = Sessions::new(ttl);
            let mut naive: BTreeMap<SessionId, (WorkerId, Duration)> = BTreeMap::new();
            let mut now = Duration::ZERO;
            for (session, worker, step, lookup) in ops {
                now += Duration::from_secs(step % 7);
                let session = SessionId::new(session);
                if lookup {
                    let want = naive
                        .get(&session)
                        .filter(|&&(_, last)| last + ttl > now)
                        .map(|&(w, _)| w);
                    prop_assert_eq!(s.worker(session, now), want);
                } else {
                    s.record(session, WorkerId::new(worker), now);
                    naive.insert(session, (WorkerId::new(worker), now));
                }
                let live = naive.values().filter(|&&(_, last)| last + ttl > now).count();
                s.expire(now);
                prop_assert_eq!(s.len(), live);
                prop_assert!(s.uses.iter().all(|&(t, _)| t + ttl > now));
            }
        }
    }

    #[test]
    fn a_late_use_does_not_undo_a_newer_one() {
        let mut s = Sessions::new(Duration::from_secs(10));
        let id = SessionId::new(1);
        s.record(id, WorkerId::new(2), Duration::from_secs(5));
        s.record(id, WorkerId::new(3), Duration::from_secs(4));
        assert_eq!(s.worker(id, Duration::from_secs(6)), Some(WorkerId::new(2)));
        assert_eq!(s.worker(id, Duration::from_secs(15)), None);
    }
}
