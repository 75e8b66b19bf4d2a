//! Discovery's metrics, named and described in one place, and the counters a running
//! [`super::Discovery`] keeps for itself (tests and logs read those; the Prometheus
//! recorder is process-wide).
//!
//! The age of the last sync is exported as a timestamp
//! (`pdgate_discovery_last_sync_timestamp_seconds`, Unix seconds), not as an age gauge: a
//! timestamp stays true when nothing updates it (a stuck task leaves an age gauge looking
//! fresh, or needs a timer that can stall as well), and the age is one PromQL expression
//! away: `time() - pdgate_discovery_last_sync_timestamp_seconds`.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::types::Role;

// The names and descriptions live in the telemetry table with every other series.
pub use crate::telemetry::{
    DISCOVERY_LAST_SYNC as LAST_SYNC, DISCOVERY_PODS as PODS,
    DISCOVERY_WATCH_ERRORS as WATCH_ERRORS, DISCOVERY_WATCH_RESTARTS as WATCH_RESTARTS,
    DISCOVERY_WORKERS as WORKERS,
};

/// A discovery's own counters.
#[derive(Debug, Default)]
pub struct Stats {
    pub reconciles: AtomicU64,
    pub watch_errors: AtomicU64,
    pub watch_restarts: AtomicU64,
    /// Complete LISTs (a watcher's initial list and every relist).
    pub lists: AtomicU64,
}

/// A copy of [`Stats`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub reconciles: u64,
    pub watch_errors: u64,
    pub watch_restarts: u64,
    pub lists: u64,
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            reconciles: self.reconciles.load(Ordering::Relaxed),
            watch_errors: self.watch_errors.load(Ordering::Relaxed),
            watch_restarts: self.watch_restarts.load(Ordering::Relaxed),
            lists: self.lists.load(Ordering::Relaxed),
        }
    }

    pub fn watch_error(&self, role: Role) {
        self.watch_errors.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(WATCH_ERRORS, "role" => role.as_str()).increment(1);
    }

    pub fn watch_restart(&self, role: Role) {
        self.watch_restarts.fetch_add(1, Ordering::Relaxed);
        metrics::counter!(WATCH_RESTARTS, "role" => role.as_str()).increment(1);
    }
}
