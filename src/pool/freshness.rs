//! When the router last confirmed each bootstrap rank of a prefill: atomics shared by
//! every snapshot the worker appears in, so that a confirmation (a rank's own route read,
//! or a heartbeat whose sentinel answered ready with the same layout) never rebuilds the
//! snapshot. Only rank *transitions* do (see `bootstrap::tracker`).
//!
//! Invariants:
//! - A stamp only moves forward (`fetch_max`); 0 means "never confirmed".
//! - A rank's last confirmation is the later of its own route read and the last whole
//!   confirmation. A whole confirmation vouches only for what the routes already said:
//!   SGLang's bootstrap server never drops a registered rank while it lives, and a
//!   sentinel that answers ready with the same layout is that same server (a restart
//!   answers 503 until every rank registered again, and is seen as one by the health
//!   checker). A rank whose route was not `Ready` is not routable whatever its stamp.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RankFreshness {
    base: Instant,
    ranks: Box<[AtomicU64]>,
    whole: AtomicU64,
}

impl RankFreshness {
    pub fn new(dp: u32) -> RankFreshness {
        RankFreshness {
            base: Instant::now(),
            ranks: (0..dp.max(1)).map(|_| AtomicU64::new(0)).collect(),
            whole: AtomicU64::new(0),
        }
    }

    /// Ranks covered.
    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ranks.is_empty()
    }

    fn stamp(&self, at: Instant) -> u64 {
        let ns = at.saturating_duration_since(self.base).as_nanos();
        u64::try_from(ns).unwrap_or(u64::MAX - 1) + 1
    }

    fn instant(&self, stamp: u64) -> Option<Instant> {
        (stamp > 0).then(|| self.base + Duration::from_nanos(stamp - 1))
    }

    /// `rank`'s own route was read at `at`.
    pub fn checked(&self, rank: usize, at: Instant) {
        if let Some(r) = self.ranks.get(rank) {
            r.fetch_max(self.stamp(at), Ordering::Relaxed);
        }
    }

    /// The bootstrap server confirmed, at `at`, that the routes read before still hold.
    pub fn confirm_all(&self, at: Instant) {
        self.whole.fetch_max(self.stamp(at), Ordering::Relaxed);
    }

    /// When `rank` was last confirmed, if ever.
    pub fn last_confirmed(&self, rank: usize) -> Option<Instant> {
        let own = self.ranks.get(rank)?.load(Ordering::Relaxed);
        if own == 0 {
            return None;
        }
        self.instant(own.max(self.whole.load(Ordering::Relaxed)))
    }

    /// Whether `rank` was confirmed within `bound` of now.
    pub fn fresh_within(&self, rank: usize, bound: Duration) -> bool {
        self.last_confirmed(rank)
            .is_some_and(|t| t.elapsed() <= bound)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_only_move_forward_and_whole_needs_own() {
        let f = RankFreshness::new(2);
        assert_eq!(f.len(), 2);
        assert!(f.last_confirmed(0).is_none());
        let t0 = Instant::now();
        f.confirm_all(t0 + Duration::from_secs(5));
        assert!(f.last_confirmed(0).is_none(), "never read: no vouching");
        f.checked(0, t0 + Duration::from_secs(1));
        assert_eq!(f.last_confirmed(0), Some(t0 + Duration::from_secs(5)));
        f.checked(1, t0 + Duration::from_secs(7));
        f.checked(1, t0 + Duration::from_secs(6));
        assert_eq!(f.last_confirmed(1), Some(t0 + Duration::from_secs(7)));
        assert!(f.last_confirmed(2).is_none(), "no such rank");
        assert!(f.fresh_within(1, Duration::from_secs(3600)));
    }
}
