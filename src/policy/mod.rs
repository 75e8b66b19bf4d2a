//! Selection policies: pure functions over a pool [`Snapshot`] that pick one routable
//! (worker, DP rank) target. The randomness is injected (`rng`), so a policy is
//! deterministic under a seeded generator.
//!
//! Invariant: a policy only ever returns a target from `snap.targets(role)` (the routable
//! ones) and never one whose worker is in `exclude` (workers that already failed this
//! request).

mod random;
mod round_robin;

use rand::RngCore;

use crate::config::PolicyKind;
use crate::pool::Snapshot;
use crate::types::{Role, Target, WorkerId};

pub use random::Random;
pub use round_robin::RoundRobin;

pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    fn pick(
        &self,
        snap: &Snapshot,
        role: Role,
        exclude: &[WorkerId],
        rng: &mut dyn RngCore,
    ) -> Option<Target>;
}

pub fn build(kind: PolicyKind) -> Box<dyn Policy> {
    match kind {
        PolicyKind::Random => Box::new(Random),
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
    }
}

/// The first eligible target scanning cyclically from `start`.
fn scan_from(targets: &[Target], start: usize, exclude: &[WorkerId]) -> Option<Target> {
    let n = targets.len();
    (0..n)
        .map(|i| targets[(start + i) % n])
        .find(|t| !exclude.contains(&t.worker))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::Pool;
    use crate::upstream::parse_base_url;
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn snapshot(healthy: &[bool]) -> std::sync::Arc<Snapshot> {
        let pool = Pool::new();
        for (i, h) in healthy.iter().enumerate() {
            let id = pool.add_worker(
                Role::Decode,
                parse_base_url(&format!("http://127.0.0.1:{}", 1000 + i)).unwrap(),
                None,
            );
            pool.update_worker(Role::Decode, id, |w| {
                w.healthy = *h;
                w.dp_size = Some(2);
            });
        }
        pool.load_full()
    }

    proptest! {
        #[test]
        fn never_picks_unroutable_or_excluded(healthy in proptest::collection::vec(any::<bool>(), 0..6), excl in 0u32..7, seed: u64) {
            let snap = snapshot(&healthy);
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            for kind in [PolicyKind::Random, PolicyKind::RoundRobin] {
                let p = build(kind);
                for _ in 0..8 {
                    let got = p.pick(&snap, Role::Decode, &[WorkerId(excl)], &mut rng);
                    let possible = healthy.iter().enumerate().any(|(i, h)| *h && i as u32 != excl);
                    match got {
                        Some(t) => {
                            prop_assert!(healthy[t.worker.0 as usize]);
                            prop_assert!(t.worker != WorkerId(excl));
                            prop_assert!(t.rank < 2);
                        }
                        None => prop_assert!(!possible),
                    }
                }
            }
        }
    }

    #[test]
    fn round_robin_cycles_every_target() {
        let snap = snapshot(&[true, true]);
        let p = RoundRobin::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let picks: std::collections::HashSet<_> = (0..4)
            .map(|_| p.pick(&snap, Role::Decode, &[], &mut rng).unwrap())
            .collect();
        assert_eq!(picks.len(), 4);
    }
}
