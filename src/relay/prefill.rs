//! The prefill leg once both legs were sent: its future, polled inline by whoever holds
//! the request (the attempt, then the response body), and the watch of its bootstrap
//! server's loss epochs.
//!
//! Invariants:
//! - The leg has no task of its own while the request holds it: dropping the watch closes
//!   the leg's connection at once (its [`LegCancel`] aborts it at the engine).
//! - A loss is judged against the epochs taken when the pair was chosen ([`LostSeen`]),
//!   before any await, so a loss during the preflight is still seen.
//! - A detached leg (decode's answer complete first) runs on to its own end, bounded by its
//!   deadline, holding its rank's load counter and the request's admission slot.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::watch;

use crate::admission::Slot;
use crate::error::{FailReason, Failure};
use crate::legs::{LegCancel, PrefillDone};
use crate::pool::{LoadGuard, LostEpochs};
use crate::types::{DpRank, Role};

type LostFuture = Pin<Box<dyn Future<Output = &'static str> + Send>>;

/// The prefill leg's future (sent, read, classified).
pub type PrefillFuture = Pin<Box<dyn Future<Output = Result<PrefillDone, Failure>> + Send>>;

/// What a detached prefill leg records when it ends well (see [`PrefillWatch::detach`]).
pub type Verdict = (
    std::sync::Arc<crate::pool::Pool>,
    crate::types::WorkerId,
    Option<crate::pool::TrialGuard>,
);

/// Drives the prefill leg; resolves with its outcome, or `PrefillLost` when the prefill's
/// bootstrap heartbeat is lost first. The leg is polled inline by whoever holds this (the
/// attempt, then the response body): no task of its own, so dropping it closes the leg's
/// connection at once.
pub struct PrefillWatch {
    leg: Option<PrefillFuture>,
    lost: LostFuture,
    cancel: LegCancel,
    guard: Option<LoadGuard>,
}

/// The prefill's loss epochs a request's watch compares against: taken when its pair was
/// chosen, before any await (the preflight), so that a loss meanwhile is still seen.
#[derive(Clone, Copy, Debug)]
pub struct LostSeen {
    heartbeat: u64,
    rank: u64,
}

impl LostSeen {
    pub fn of(lost: &watch::Receiver<LostEpochs>, rank: DpRank) -> LostSeen {
        let e = lost.borrow();
        LostSeen {
            heartbeat: e.heartbeat,
            rank: e.rank(rank as usize),
        }
    }
}

impl PrefillWatch {
    pub fn new(
        leg: PrefillFuture,
        mut lost: watch::Receiver<LostEpochs>,
        rank: DpRank,
        seen: LostSeen,
        cancel: LegCancel,
        guard: LoadGuard,
    ) -> PrefillWatch {
        let k = rank as usize;
        let LostSeen {
            heartbeat,
            rank: rank_seen,
        } = seen;
        // One waiter on one channel: woken by any loss on this prefill, it ends only on
        // a loss of the whole prefill or of this request's rank.
        let lost = Box::pin(async move {
            let seen = lost
                .wait_for(|e| e.heartbeat != heartbeat || e.rank(k) != rank_seen)
                .await
                .map(|e| e.heartbeat != heartbeat);
            let whole = match seen {
                Ok(whole) => whole,
                // The worker left the pool: its health loop reports that, not this watch.
                Err(_) => std::future::pending().await,
            };
            if whole {
                "lost the prefill's bootstrap server (heartbeat) while the request was in flight"
            } else {
                "the prefill's DP rank stopped being ready (its bootstrap route went away) while the request was in flight"
            }
        });
        PrefillWatch {
            leg: Some(leg),
            lost,
            cancel,
            guard: Some(guard),
        }
    }

    /// Lets the prefill leg run to its own end (bounded by its deadline) without this
    /// request: no abort, no cancel. The leg keeps counting as in flight on its rank, and
    /// keeps the request's admission slot, until it ends.
    ///
    /// `verdict`: the pool and the prefill's id, to record its success when the leg ends
    /// well, and its half-open trial, freed after that verdict.
    pub fn detach(mut self, slot: Option<Slot>, verdict: Option<Verdict>) {
        self.cancel.disarm();
        if let Some(leg) = self.leg.take() {
            let guard = self.guard.take();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    let _held = (guard, slot);
                    let ok = leg.await.is_ok();
                    if let Some((pool, id, trial)) = verdict {
                        if ok {
                            pool.report_success(Role::Prefill, id);
                        }
                        drop(trial);
                    }
                });
            }
        }
    }
}

impl Future for PrefillWatch {
    type Output = Result<PrefillDone, Failure>;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let Some(leg) = this.leg.as_mut() else {
            return Poll::Ready(Err(Failure::new(
                FailReason::Internal,
                "prefill leg polled after it ended",
            )));
        };
        if let Poll::Ready(r) = leg.as_mut().poll(cx) {
            this.leg = None;
            this.guard = None;
            // A prefill that answered (even with an error) needs no abort.
            this.cancel.disarm();
            return Poll::Ready(r);
        }
        if let Poll::Ready(why) = this.lost.as_mut().poll(cx) {
            return Poll::Ready(Err(Failure::new(FailReason::PrefillLost, why)));
        }
        Poll::Pending
    }
}
