//! Power of two choices: sample two distinct workers at random and take the less loaded.
//!
//! Why: picking the least loaded of *all* workers herds every router replica (and every
//! request between two load reports) onto the same worker; two random choices keep almost
//! all of the balancing benefit (max load drops from O(log n / log log n) to
//! O(log log n) above the mean, Mitzenmacher) while staying robust to stale load.
//!
//! Load of a candidate ([`load`]) = pdgate's own requests in flight on its routable ranks
//! **plus** the engine's last reported running + waiting requests on those ranks (0 when
//! `policy.load_poll_interval_ms` is 0). The sum counts pdgate's own requests twice once
//! the engine has seen them; that is deliberate: the in-flight term is exact and immediate
//! (it moves between two polls, which is what prevents bursts from herding), while the
//! engine term is stale but carries what this replica cannot see (other replicas' traffic,
//! queueing, long generations). Both are monotone in the true load, so their sum is too.
//!
//! Invariants: returns an index `< cands.len()`; with at least two candidates the two
//! samples are distinct; ties keep the first sample (itself uniform), so the choice among
//! equally loaded workers is uniform. No locks, no allocation.

use rand::{Rng, RngCore};

use super::{Candidate, Chosen, PickCtx, Policy};

/// The load a policy compares: in flight plus engine-reported (saturating).
pub fn load(c: &Candidate<'_>) -> u64 {
    c.in_flight.saturating_add(c.engine_load)
}

#[derive(Debug, Default)]
pub struct PowerOfTwo;

impl PowerOfTwo {
    /// The pick itself, shared with `cache_aware`'s fallback.
    pub(super) fn choose(cands: &[Candidate<'_>], rng: &mut dyn RngCore) -> usize {
        let n = cands.len();
        if n <= 1 {
            return 0;
        }
        let a = rng.random_range(0..n);
        let mut b = rng.random_range(0..n - 1);
        if b >= a {
            b += 1;
        }
        if load(&cands[b]) < load(&cands[a]) {
            b
        } else {
            a
        }
    }
}

impl Policy for PowerOfTwo {
    fn name(&self) -> &'static str {
        "power_of_two"
    }
    fn pick(&self, cands: &[Candidate<'_>], _ctx: &PickCtx<'_>, rng: &mut dyn RngCore) -> Chosen {
        Chosen::worker(Self::choose(cands, rng))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::Pool;
    use crate::types::Role;
    use crate::upstream::parse_base_url;
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn pool(n: usize) -> Pool {
        let pool = Pool::new();
        for i in 0..n {
            let url = parse_base_url(&format!("http://10.0.0.{i}:30000")).unwrap();
            pool.add_worker(Role::Decode, url, None);
        }
        pool
    }

    proptest! {
        #[test]
        fn never_takes_the_unique_most_loaded(loads in proptest::collection::vec((0u64..20, 0u64..20), 1..9), seed: u64) {
            let pool = pool(loads.len());
            let snap = pool.load_full();
            let cands: Vec<Candidate<'_>> = loads
                .iter()
                .zip(&snap.decodes)
                .map(|((f, e), w)| Candidate { worker: w, ranks: &[0], in_flight: *f, engine_load: *e })
                .collect();
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let max = cands.iter().map(load).max().unwrap();
            let unique_max = cands.iter().filter(|c| load(c) == max).count() == 1;
            for _ in 0..16 {
                let i = PowerOfTwo.pick(&cands, &PickCtx::default(), &mut rng).index;
                prop_assert!(i < cands.len());
                if cands.len() >= 2 && unique_max {
                    prop_assert!(load(&cands[i]) < max);
                }
                if cands.len() == 2 {
                    prop_assert_eq!(load(&cands[i]), load(&cands[0]).min(load(&cands[1])));
                }
            }
        }
    }

    #[test]
    fn engine_load_counts_and_equal_loads_spread() {
        let pool = pool(2);
        let snap = pool.load_full();
        let mk = |i: usize, f, e| Candidate {
            worker: &snap.decodes[i],
            ranks: &[0],
            in_flight: f,
            engine_load: e,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        // Worker 0 has fewer of pdgate's requests but a longer engine queue.
        let cands = [mk(0, 1, 9), mk(1, 3, 0)];
        for _ in 0..20 {
            assert_eq!(
                PowerOfTwo.pick(&cands, &PickCtx::default(), &mut rng).index,
                1
            );
        }
        let cands = [mk(0, 2, 2), mk(1, 4, 0)];
        let mut seen = [0; 2];
        for _ in 0..400 {
            seen[PowerOfTwo.pick(&cands, &PickCtx::default(), &mut rng).index] += 1;
        }
        assert!(seen[0] > 150 && seen[1] > 150, "{seen:?}");
        assert_eq!(load(&mk(0, u64::MAX, 5)), u64::MAX);
    }
}
