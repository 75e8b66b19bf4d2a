//! Uniformly random over the eligible workers.

use rand::{Rng, RngCore};

use super::{Candidate, Chosen, PickCtx, Policy};

#[derive(Debug, Default)]
pub struct Random;

impl Policy for Random {
    fn name(&self) -> &'static str {
        "random"
    }
    fn pick(&self, cands: &[Candidate<'_>], _ctx: &PickCtx<'_>, rng: &mut dyn RngCore) -> Chosen {
        Chosen::worker(rng.random_range(0..cands.len()))
    }
}
