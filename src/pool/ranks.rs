//! What the router knows of each prefill DP rank's bootstrap (readiness, why it failed)
//! and the request path's rank checks (preflight), at most one in flight per rank (single
//! flight, lock-free: a slot is claimed by compare-and-swap).

use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwapOption;
use tokio::sync::watch;

use crate::types::DpRank;

/// The router's view of what a decode engine would find for one (prefill, DP rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankReadiness {
    Unknown,
    Bootstrapping,
    Ready,
    Failed { reason: RankFailure, since: Instant },
}

impl RankReadiness {
    pub fn label(&self) -> &'static str {
        match self {
            RankReadiness::Unknown => "unknown",
            RankReadiness::Bootstrapping => "bootstrapping",
            RankReadiness::Ready => "ready",
            RankReadiness::Failed { .. } => "failed",
        }
    }
}

/// Why a rank cannot bootstrap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankFailure {
    /// The bootstrap server did not answer (connect error, timeout, heartbeat lost).
    Unreachable,
    /// The rank is not registered (404 once the server is ready).
    RankMissing,
    /// An answer that makes no sense (bad JSON, unexpected status).
    BadAnswer,
}

impl RankFailure {
    pub fn label(self) -> &'static str {
        match self {
            RankFailure::Unreachable => "unreachable",
            RankFailure::RankMissing => "rank_missing",
            RankFailure::BadAnswer => "bad_answer",
        }
    }
}

/// What a request-path rank check (preflight) found; shared by every request that waited
/// on the same check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PreflightOutcome {
    Ready,
    /// The bootstrap server is not ready yet (503).
    NotReady,
    /// The rank is not registered.
    Missing(String),
    /// The bootstrap server did not answer usefully.
    Unreachable(String),
}

/// One preflight in flight: its result, once known.
pub type Probe = watch::Receiver<Option<PreflightOutcome>>;

/// Per DP rank, the preflight in flight (if any): at most one check per rank runs at a
/// time, and requests that find one wait on it (single flight). Lock-free: a slot is
/// claimed with a compare-and-swap. Shared by every snapshot the worker appears in.
#[derive(Debug, Default)]
pub struct RankProbes(Box<[ArcSwapOption<Probe>]>);

impl RankProbes {
    pub(super) fn new(dp: u32) -> RankProbes {
        RankProbes((0..dp.max(1)).map(|_| ArcSwapOption::empty()).collect())
    }

    /// The check in flight on `rank`, or `Err(claim)` when there is none and this caller
    /// now owns the slot (it must run the check and [`RankProbes::finish`] it).
    pub fn join_or_claim(
        &self,
        rank: DpRank,
    ) -> Option<Result<Probe, watch::Sender<Option<PreflightOutcome>>>> {
        let slot = self.0.get(rank as usize)?;
        loop {
            if let Some(p) = slot.load_full() {
                // A check whose task ended without an answer (it cannot, short of a
                // runtime going away) must not hold the slot forever: take it over.
                if p.has_changed().is_err() && p.borrow().is_none() {
                    slot.compare_and_swap(&p, None);
                    continue;
                }
                return Some(Ok((*p).clone()));
            }
            let (tx, rx) = watch::channel(None);
            let prev = slot.compare_and_swap(&None::<Arc<Probe>>, Some(Arc::new(rx)));
            if prev.is_none() {
                return Some(Err(tx));
            }
            // Someone else claimed it between the load and the swap: join theirs.
        }
    }

    /// Publishes the claimed check's outcome and frees the slot.
    pub fn finish(
        &self,
        rank: DpRank,
        tx: watch::Sender<Option<PreflightOutcome>>,
        outcome: PreflightOutcome,
    ) {
        tx.send_replace(Some(outcome));
        if let Some(slot) = self.0.get(rank as usize) {
            slot.store(None);
        }
    }
}

#[cfg(test)]
mod probe_tests {
    use super::*;

    #[test]
    fn one_check_per_rank_and_an_abandoned_one_is_taken_over() {
        let probes = RankProbes::new(2);
        let Some(Err(claim)) = probes.join_or_claim(0) else {
            panic!("the first caller claims the check");
        };
        assert!(
            matches!(probes.join_or_claim(0), Some(Ok(_))),
            "later callers join it"
        );
        assert!(
            matches!(probes.join_or_claim(1), Some(Err(_))),
            "another rank is another check"
        );
        assert!(probes.join_or_claim(2).is_none(), "no such rank");
        // The claimed check ends without an answer: the next caller claims a new one.
        drop(claim);
        assert!(matches!(probes.join_or_claim(0), Some(Err(_))));
    }

    #[tokio::test]
    async fn waiters_get_the_outcome_and_the_slot_is_freed() {
        let probes = RankProbes::new(1);
        let Some(Err(claim)) = probes.join_or_claim(0) else {
            panic!("claim");
        };
        let Some(Ok(mut waiter)) = probes.join_or_claim(0) else {
            panic!("join");
        };
        probes.finish(0, claim, PreflightOutcome::Ready);
        let got = waiter.wait_for(Option::is_some).await.map(|v| v.clone());
        assert_eq!(got.ok().flatten(), Some(PreflightOutcome::Ready));
        assert!(matches!(probes.join_or_claim(0), Some(Err(_))), "freed");
    }
}
