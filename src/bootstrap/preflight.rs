//! The request-path rank check: when a prefill rank's view is older than the freshness
//! bound, the request asks the bootstrap server once more (briefly) before it dispatches.
//!
//! Invariants:
//! - Single flight: at most one check per (prefill, rank) is in flight; every request that
//!   needs the same rank meanwhile waits on that check's outcome ([`RankProbes`]).
//! - No lock on the request path: the check runs in a task of its own, which writes the
//!   outcome to the pool (the pool's writer mutex is taken there, never by a request), then
//!   publishes it to the waiters. A request that goes away does not cancel the check.
//! - Bounded: the check has the preflight timeout, and so does every wait on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::client::{self, BootstrapError, Generation, RankRoute};
use super::tracker;
use crate::pool::{BootstrapInfo, Pool, PreflightOutcome, RankProbes};
use crate::types::{DpRank, Role, WorkerId};
use crate::upstream::Upstream;

/// What a preflight needs to know about the prefill.
pub struct Target<'a> {
    pub worker: WorkerId,
    pub rank: DpRank,
    pub bootstrap: &'a BootstrapInfo,
    pub generation: Generation,
    pub probes: &'a Arc<RankProbes>,
}

/// Checks `t.rank` now, or waits on the check already in flight for it.
pub async fn check(
    pool: &Arc<Pool>,
    up: &Upstream,
    t: Target<'_>,
    timeout: Duration,
) -> PreflightOutcome {
    let probe = match t.probes.join_or_claim(t.rank) {
        Some(Ok(probe)) => probe,
        Some(Err(claim)) => {
            let probe = claim.subscribe();
            let (pool, up, probes) = (pool.clone(), up.clone(), t.probes.clone());
            let (id, rank, generation) = (t.worker, t.rank, t.generation);
            let url = t.bootstrap.url.clone();
            let task = async move {
                let res = client::rank_route(&up, &url, generation, rank, timeout).await;
                let outcome = apply(&pool, id, rank, &res);
                probes.finish(rank, claim, outcome);
            };
            match tokio::runtime::Handle::try_current() {
                Ok(rt) => {
                    rt.spawn(task);
                }
                Err(_) => return PreflightOutcome::Unreachable("no runtime".to_string()),
            }
            probe
        }
        // The snapshot's worker has no such rank (its layout changed): not routable.
        None => return PreflightOutcome::NotReady,
    };
    wait(probe, timeout).await
}

async fn wait(mut probe: crate::pool::Probe, timeout: Duration) -> PreflightOutcome {
    let got = tokio::time::timeout(timeout, probe.wait_for(Option::is_some)).await;
    match got {
        Ok(Ok(v)) => v
            .clone()
            .unwrap_or_else(|| PreflightOutcome::Unreachable("no outcome".to_string())),
        Ok(Err(_)) => PreflightOutcome::Unreachable("the check ended without an answer".into()),
        Err(_) => PreflightOutcome::Unreachable(format!("no answer within {timeout:?}")),
    }
}

/// Writes a check's result to the pool (from the check's own task) and returns the
/// outcome its waiters act on.
fn apply(
    pool: &Pool,
    id: WorkerId,
    rank: DpRank,
    res: &Result<RankRoute, BootstrapError>,
) -> PreflightOutcome {
    let now = Instant::now();
    pool.update_worker_if(Role::Prefill, id, |w| {
        tracker::apply_rank(w, rank as usize, res, now)
    });
    let ok = matches!(res, Ok(RankRoute::Ready { .. }));
    if let Some(w) = pool.load().worker(Role::Prefill, id) {
        if res.is_ok() {
            w.per_rank.fresh.checked(rank as usize, now);
        }
        if !ok {
            // A failed check is a signal: the tracker re-reads every route now.
            w.shared.refresh.notify_one();
        }
    }
    metrics::counter!(crate::telemetry::PREFLIGHT_CHECKS, "ok" => if ok { "true" } else { "false" })
        .increment(1);
    match res {
        Ok(RankRoute::Ready { .. }) => PreflightOutcome::Ready,
        Ok(RankRoute::NotReady) => PreflightOutcome::NotReady,
        Ok(RankRoute::Missing(m)) => PreflightOutcome::Missing(m.clone()),
        Err(e) => PreflightOutcome::Unreachable(e.to_string()),
    }
}
