//! Uniformly random over the routable targets.

use rand::{Rng, RngCore};

use super::{scan_from, Policy};
use crate::pool::Snapshot;
use crate::types::{Role, Target, WorkerId};

#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn pick(
        &self,
        snap: &Snapshot,
        role: Role,
        exclude: &[WorkerId],
        rng: &mut dyn RngCore,
    ) -> Option<Target> {
        let targets = snap.targets(role);
        if targets.is_empty() {
            return None;
        }
        scan_from(targets, rng.random_range(0..targets.len()), exclude)
    }
}
