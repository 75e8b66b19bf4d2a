//! Round robin over the eligible workers (one shared counter, lock-free).

use std::sync::atomic::{AtomicUsize, Ordering};

use rand::RngCore;

use super::{Candidate, Chosen, PickCtx, Policy};

#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Policy for RoundRobin {
    fn name(&self) -> &'static str {
        "round_robin"
    }
    fn pick(&self, cands: &[Candidate<'_>], _ctx: &PickCtx<'_>, _rng: &mut dyn RngCore) -> Chosen {
        Chosen::worker(self.next.fetch_add(1, Ordering::Relaxed) % cands.len())
    }
}
