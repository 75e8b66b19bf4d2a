//! Per-worker request statistics: leg outcomes, prefill leg times and decode first-byte
//! times, kept in the worker's own atomics and rendered at scrape time ([`super::series`]).
//!
//! Why atomics in the worker and not `metrics` calls: a label per worker would be built per
//! request, and the Prometheus recorder can never forget a series, so a worker removed (or
//! re-added under the same URL) would leave its series behind. Here a request does one
//! relaxed add, and a worker that leaves the pool leaves the exposition at the next scrape.
//!
//! Invariants: the outcome of a leg is counted where its breaker hears it
//! ([`super::Pool::report_success`], [`super::Pool::report_failure`]): once per verdict, `ok`
//! or the reason blamed on this worker's leg. Times are observed for legs that answered.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::error::FailReason;
use crate::telemetry::{AtomicHistogram, LATENCY_BUCKETS};

/// Outcome slots: `ok`, then one per [`FailReason::ALL`].
const OUTCOMES: usize = FailReason::ALL.len() + 1;

/// One worker's statistics (shared by its state and every snapshot's view of it).
#[derive(Debug)]
pub struct WorkerStats {
    outcomes: [AtomicU64; OUTCOMES],
    /// Prefill: the prefill leg, from its send to its answer.
    pub prefill: AtomicHistogram,
    /// Decode: from the legs' send to the decode's first bytes.
    pub first_byte: AtomicHistogram,
}

impl Default for WorkerStats {
    fn default() -> WorkerStats {
        WorkerStats {
            outcomes: std::array::from_fn(|_| AtomicU64::new(0)),
            prefill: AtomicHistogram::new(LATENCY_BUCKETS),
            first_byte: AtomicHistogram::new(LATENCY_BUCKETS),
        }
    }
}

impl WorkerStats {
    /// A leg on this worker ended: `None` when it succeeded.
    pub fn outcome(&self, failed: Option<FailReason>) {
        let i = match failed {
            None => 0,
            Some(r) => FailReason::ALL
                .iter()
                .position(|x| *x == r)
                .map_or(0, |i| i + 1),
        };
        if let Some(c) = self.outcomes.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `(outcome label, count)`: `ok` always, a failure reason once it has happened.
    pub fn outcomes(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.outcomes.iter().enumerate().filter_map(|(i, c)| {
            let n = c.load(Ordering::Relaxed);
            match i.checked_sub(1) {
                None => Some(("ok", n)),
                Some(_) if n == 0 => None,
                Some(j) => FailReason::ALL.get(j).map(|r| (r.as_str(), n)),
            }
        })
    }

    pub fn prefill_done(&self, took: Duration) {
        self.prefill.observe(took);
    }

    pub fn first_byte(&self, took: Duration) {
        self.first_byte.observe(took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_by_reason() {
        let s = WorkerStats::default();
        assert_eq!(s.outcomes().collect::<Vec<_>>(), vec![("ok", 0)]);
        for f in [
            None,
            None,
            Some(FailReason::PrefillTimeout),
            Some(FailReason::Internal),
        ] {
            s.outcome(f);
        }
        assert_eq!(
            s.outcomes().collect::<Vec<_>>(),
            vec![
                ("ok", 2),
                (FailReason::PrefillTimeout.as_str(), 1),
                (FailReason::Internal.as_str(), 1)
            ]
        );
    }
}
