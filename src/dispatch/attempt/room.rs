//! Room allocation under the room-to-rank contract (spec §4.4 R1, R5, R9).
//!
//! Invariants (property-tested below):
//! - every room is `<= 2^63 - 1`;
//! - every room of one attempt satisfies `room % dp == rank` (so the prefill runs each
//!   instance on the chosen rank, and the decode's modulo resolves the same rank);
//! - the rooms of one attempt are pairwise distinct;
//! - rooms are drawn from a CSPRNG, fresh for every attempt.

use std::collections::HashSet;

use rand::{Rng, RngCore};

use crate::types::Room;

/// Fills `out` with `count` distinct rooms, each `≡ rank (mod dp)`.
///
/// `dp` is the prefill's DP size (0 and 1 mean no constraint) and `rank < dp`.
pub fn assign(rng: &mut dyn RngCore, dp: u32, rank: u32, count: usize, out: &mut Vec<u64>) {
    out.clear();
    let dp = u64::from(dp.max(1));
    let rank = u64::from(rank) % dp;
    // room = rank + dp * nonce with nonce in [0, (MAX - rank) / dp]: uniform over the
    // rooms that map to `rank`.
    let max_nonce = (Room::MAX - rank) / dp;
    let draw = |rng: &mut dyn RngCore| rank + dp * rng.random_range(0..=max_nonce);
    if count <= 1 {
        out.push(draw(rng));
        return;
    }
    let mut seen = HashSet::with_capacity(count);
    while out.len() < count {
        let r = draw(rng);
        if seen.insert(r) {
            out.push(r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;

    proptest! {
        #[test]
        fn rooms_follow_the_contract(seed: u64, dp in 0u32..64, rank_seed: u32, count in 1usize..40) {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let rank = if dp == 0 { 0 } else { rank_seed % dp };
            let mut out = Vec::new();
            assign(&mut rng, dp, rank, count, &mut out);
            prop_assert_eq!(out.len(), count);
            let set: HashSet<_> = out.iter().collect();
            prop_assert_eq!(set.len(), count);
            for r in &out {
                prop_assert!(*r <= Room::MAX);
                let room = Room::new(*r).unwrap();
                prop_assert_eq!(room.rank_for(dp), rank);
            }
        }
    }

    #[test]
    fn fresh_rooms_each_call() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assign(&mut rng, 4, 3, 1, &mut a);
        assign(&mut rng, 4, 3, 1, &mut b);
        assert_ne!(a, b);
    }
}
