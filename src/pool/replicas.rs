//! The replica count and this replica's index, as admission reads them per request: how
//! many pdgate replicas share every decode rank's capacity (`pool::capacity::share`).
//!
//! Why a shared value rather than the config's copy: the count may come from Kubernetes
//! (`[admission] replica_selector`: pdgate's own pods, counted by `discovery::replicas`),
//! and then changes while the router runs, within one watch event of a replica joining or
//! leaving; a static count (`admission.replicas`, `admission.replica_index`) changes on a
//! config reload. Both write here; the request path reads one atomic word.
//!
//! Invariants:
//! - The count, the index and where they come from are one `AtomicU64`: a reader never
//!   sees the count of one write with the index of another.
//! - Lock-free: a read is one load; a write is one swap, and only a write that changes
//!   something logs (one INFO line: `replicas`, `replica_index`, `source`), sets
//!   `pdgate_admission_replicas`, and wakes the requests waiting for a decode slot (a
//!   smaller count is a larger share).
//! - With `replica_selector` set, the config never writes (discovery owns the value, and
//!   it is unknown until discovery's first complete LIST); without it, discovery never runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::capacity::CapacitySignal;
use crate::config::AdmissionConfig;
use crate::telemetry;

/// Where the count comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Source {
    /// No count: no shares (`admission.replicas = 0` and no selector, or discovery has not
    /// listed pdgate's pods yet).
    #[default]
    Unknown,
    /// `admission.replicas` (`--replicas`) and `admission.replica_index`.
    Static,
    /// pdgate's own pods, found by `admission.replica_selector`.
    Discovery,
}

impl Source {
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Unknown => "unknown",
            Source::Static => "static",
            Source::Discovery => "discovery",
        }
    }

    fn bits(self) -> u64 {
        match self {
            Source::Unknown => 0,
            Source::Static => 1,
            Source::Discovery => 2,
        }
    }

    fn from_bits(b: u64) -> Source {
        match b {
            1 => Source::Static,
            2 => Source::Discovery,
            _ => Source::Unknown,
        }
    }
}

/// One reading: the count (0 = unknown), this replica's index among them, and the source.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub replicas: u32,
    pub index: Option<u32>,
    pub source: Source,
}

/// Bits 0..32: index + 1 (0 = none); bits 32..62: the count; bits 62..64: the source.
const INDEX: u64 = 0xFFFF_FFFF;
const COUNT_MAX: u32 = (1 << 30) - 1;

impl Count {
    fn pack(self) -> u64 {
        let index = self.index.map_or(0, |i| u64::from(i) + 1);
        (self.source.bits() << 62) | (u64::from(self.replicas.min(COUNT_MAX)) << 32) | index
    }

    fn unpack(w: u64) -> Count {
        Count {
            replicas: ((w >> 32) as u32) & COUNT_MAX,
            index: (w & INDEX).checked_sub(1).map(|i| i as u32),
            source: Source::from_bits(w >> 62),
        }
    }

    /// The count `a` gives without discovery (`None`: discovery owns it).
    pub fn configured(a: &AdmissionConfig) -> Option<Count> {
        if a.replica_selector().is_some() {
            return None;
        }
        Some(match a.replicas {
            0 => Count::default(),
            n => Count {
                replicas: n,
                index: a.replica_index,
                source: Source::Static,
            },
        })
    }
}

/// The shared count (see the module docs); one per pool.
#[derive(Debug)]
pub struct Replicas {
    word: AtomicU64,
    signal: Arc<CapacitySignal>,
}

impl Replicas {
    pub fn new(signal: Arc<CapacitySignal>) -> Replicas {
        Replicas {
            word: AtomicU64::new(Count::default().pack()),
            signal,
        }
    }

    /// The count now (one load).
    pub fn get(&self) -> Count {
        Count::unpack(self.word.load(Ordering::Acquire))
    }

    /// Sets the count; true when it changed (then logged, exported, and waiters woken).
    pub fn set(&self, c: Count) -> bool {
        let new = c.pack();
        let old = self.word.swap(new, Ordering::AcqRel);
        if old == new {
            return false;
        }
        let c = Count::unpack(new);
        metrics::gauge!(telemetry::ADMISSION_REPLICAS).set(f64::from(c.replicas));
        const CHANGED: &str =
            "replica count changed: each decode rank's capacity is shared by this many replicas";
        match c.index {
            Some(i) => tracing::info!(
                replicas = c.replicas,
                replica_index = i,
                source = c.source.as_str(),
                "{CHANGED}"
            ),
            // No index (no remainder slot): the field says so rather than a number.
            None => tracing::info!(
                replicas = c.replicas,
                replica_index = "none",
                source = c.source.as_str(),
                "{CHANGED}"
            ),
        }
        self.signal.wake();
        true
    }

    /// Applies `[admission]` at start and on reload: its static count, unless discovery
    /// owns the count (`replica_selector` set).
    pub fn configure(&self, a: &AdmissionConfig) {
        if let Some(c) = Count::configured(a) {
            self.set(c);
        }
        // The gauge exists from the start, whatever the count.
        metrics::gauge!(telemetry::ADMISSION_REPLICAS).set(f64::from(self.get().replicas));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_reads_back_as_written() {
        let cases = [
            Count::default(),
            Count {
                replicas: 3,
                index: Some(0),
                source: Source::Static,
            },
            Count {
                replicas: 1024,
                index: Some(1023),
                source: Source::Discovery,
            },
            Count {
                replicas: 2,
                index: None,
                source: Source::Discovery,
            },
            Count {
                replicas: 7,
                index: Some(u32::MAX - 1),
                source: Source::Static,
            },
        ];
        for c in cases {
            assert_eq!(Count::unpack(c.pack()), c, "{c:?}");
        }
    }

    #[test]
    fn only_a_change_counts_as_one() {
        let r = Replicas::new(Arc::new(CapacitySignal::default()));
        assert_eq!(r.get(), Count::default());
        let three = Count {
            replicas: 3,
            index: Some(1),
            source: Source::Discovery,
        };
        assert!(r.set(three));
        assert!(!r.set(three));
        assert_eq!(r.get(), three);
        assert!(r.set(Count {
            index: None,
            ..three
        }));
    }

    #[test]
    fn the_config_writes_only_without_a_selector() {
        // (replicas, replica_index, replica_selector, what the config gives)
        let static_two = Count {
            replicas: 2,
            index: Some(1),
            source: Source::Static,
        };
        let table = [
            (0, None, None, Some(Count::default())),
            (2, Some(1), None, Some(static_two)),
            (2, Some(1), Some("  "), Some(static_two)),
            (0, None, Some("app=pdgate"), None),
        ];
        for (replicas, replica_index, sel, want) in table {
            let a = AdmissionConfig {
                replicas,
                replica_index,
                replica_selector: sel.map(str::to_string),
                ..AdmissionConfig::default()
            };
            assert_eq!(Count::configured(&a), want, "{a:?}");
            let r = Replicas::new(Arc::new(CapacitySignal::default()));
            r.set(Count {
                replicas: 5,
                index: None,
                source: Source::Discovery,
            });
            r.configure(&a);
            assert_eq!(r.get().replicas, want.map_or(5, |c| c.replicas), "{a:?}");
        }
    }
}
