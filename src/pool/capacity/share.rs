//! A replica's share of one decode rank's capacity, when the replica count is known.
//!
//! Why a rule of its own: replicas do not talk to each other, and each sees the others only
//! through the engine's load report, a poll old. Whatever that report says, a replica that
//! never holds more than its share keeps the sum of all replicas under the capacity, as long
//! as the shares add up to at most the capacity; and they can, because every replica computes
//! them from the same three numbers (the capacity, the replica count, the rank) without
//! talking. ARCHITECTURE.md ("Admission across replicas") has the argument.
//!
//! The rule: `⌊capacity / R⌋` each; the `capacity mod R` remainder slots go, on rank `k`, to
//! the replicas whose index `i` has `(i + k) mod R < capacity mod R` (so the remainder turns
//! from rank to rank instead of always going to replica 0). A replica that does not know its
//! index takes no remainder slot, but at least one slot: a capacity below `R` would
//! otherwise leave the rank to nobody (then the sum may reach `R`; documented).
//!
//! Invariants: pure (no state, no clock); with distinct indexes `0..R` the shares of one
//! rank add up to exactly the capacity; without an index every share is
//! `max(⌊capacity / R⌋, 1)`; `R = 0` or an unlimited rank (capacity 0) has no share.

/// The share of a rank of `capacity` requests (0 = unlimited) for replica `index` of
/// `replicas` (0 = unknown), on DP rank `rank`; `None` when no share applies. An index
/// outside `0..replicas` counts as unknown.
pub fn share(capacity: u64, replicas: u32, index: Option<u32>, rank: u32) -> Option<u64> {
    if replicas == 0 || capacity == 0 {
        return None;
    }
    let r = u64::from(replicas);
    let (base, rem) = (capacity / r, capacity % r);
    Some(match index.filter(|i| *i < replicas) {
        Some(i) => {
            let turn = (u64::from(i) + u64::from(rank)) % r;
            base + u64::from(turn < rem)
        }
        None => base.max(1),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn shares_by_table() {
        // (capacity, replicas, index, rank, share)
        let table = [
            (8, 0, Some(0), 0, None),
            (0, 3, Some(0), 0, None),
            (8, 1, None, 0, Some(8)),
            (8, 1, Some(0), 3, Some(8)),
            (4, 3, None, 0, Some(1)),
            (4, 3, Some(0), 0, Some(2)),
            (4, 3, Some(1), 0, Some(1)),
            (4, 3, Some(2), 1, Some(2)),
            (2, 5, None, 0, Some(1)),
            (2, 5, Some(2), 0, Some(0)),
            (2, 5, Some(4), 1, Some(1)),
            (9, 3, Some(7), 0, Some(3)),
        ];
        for (cap, r, i, k, want) in table {
            assert_eq!(share(cap, r, i, k), want, "{cap} {r} {i:?} {k}");
        }
    }

    proptest! {
        /// With every index known, a rank's shares add up to its capacity exactly; without
        /// them, to at most the capacity when it is at least R (else R, one slot each).
        #[test]
        fn shares_add_up(cap in 1u64..1000, r in 1u32..40, rank in 0u32..64) {
            let known: u64 = (0..r).filter_map(|i| share(cap, r, Some(i), rank)).sum();
            prop_assert_eq!(known, cap);
            let unknown: u64 = (0..r).filter_map(|_| share(cap, r, None, rank)).sum();
            prop_assert!(unknown <= cap.max(u64::from(r)));
            prop_assert!(unknown <= cap || cap < u64::from(r));
        }
    }
}
