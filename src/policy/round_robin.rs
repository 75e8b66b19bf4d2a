//! Round robin over the routable targets (one shared counter, lock-free).

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::RngCore;

use super::{scan_from, Policy};
use crate::pool::Snapshot;
use crate::types::{Role, Target, WorkerId};

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn pick(
        &self,
        snap: &Snapshot,
        role: Role,
        exclude: &[WorkerId],
        _rng: &mut dyn RngCore,
    ) -> Option<Target> {
        let targets = snap.targets(role);
        if targets.is_empty() {
            return None;
        }
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        scan_from(targets, start % targets.len(), exclude)
    }
}
