//! Decode picks under capacity: full ranks and workers are skipped, and the rank is chosen
//! by outstanding work (KV tokens in flight) where the engine reports it.

use super::*;
use crate::pool::capacity::{Limits, Need, Reported};
use crate::pool::{LoadGuard, Pool};
use crate::upstream::parse_base_url;
use rand::SeedableRng;

fn decodes(n: usize, dp: u32) -> Pool {
    let pool = Pool::new();
    for i in 0..n {
        let id = pool.add_worker(
            Role::Decode,
            parse_base_url(&format!("http://127.0.0.1:{}", 2000 + i)).unwrap(),
            None,
        );
        pool.update_worker(Role::Decode, id, |w| {
            w.facts.healthy = true;
            w.facts.dp_size = Some(dp);
        });
    }
    pool
}

fn need(override_per_rank: u64) -> Need {
    Need {
        limits: Limits {
            override_per_rank,
            learn_from_engine: true,
            kv_bound: true,
            ..Limits::default()
        },
        tokens: 10,
        slots: 1,
    }
}

fn report(busy: u64, tokens: Option<u64>) -> Reported {
    Reported {
        busy: Some(busy),
        max_running: Some(8),
        tokens,
        max_tokens: tokens.map(|_| 100_000),
        prealloc: None,
        waiting: None,
    }
}

#[test]
fn the_decode_rank_follows_tokens_in_flight_where_reported() {
    // (rank 0: engine busy, tokens; rank 1: the same; pdgate's own in flight on rank 0;
    // the rank picked)
    type Rank = (u64, Option<u64>);
    let table: &[(Rank, Rank, usize, DpRank)] = &[
        // Tokens reported: fewer tokens wins, whatever the request counts.
        ((1, Some(9000)), (3, Some(500)), 0, 1),
        ((3, Some(500)), (1, Some(9000)), 0, 0),
        ((0, Some(100)), (0, Some(200)), 2, 0),
        // No token figures: the fewest requests in flight, as before.
        ((0, None), (0, None), 1, 1),
    ];
    for (r0, r1, own0, want) in table {
        let pool = decodes(1, 2);
        let snap = pool.load_full();
        let w = &snap.decodes[0];
        w.per_rank.capacity[0].observe(&report(r0.0, r0.1));
        w.per_rank.capacity[1].observe(&report(r1.0, r1.1));
        let _g: Vec<LoadGuard> = (0..*own0).map(|_| LoadGuard::new(w, 0)).collect();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let ctx = PickCtx {
            need: Some(need(0)),
            ..PickCtx::default()
        };
        for kind in ALL_KINDS {
            let p = build(kind);
            let got =
                select(p.as_ref(), &snap, Role::Decode, &ctx, &mut rng).map(|p| p.target.rank);
            assert_eq!(got, Some(*want), "{kind:?} {r0:?} {r1:?} own {own0}");
        }
    }
}

#[test]
fn full_ranks_and_workers_are_skipped() {
    let pool = decodes(2, 2);
    let snap = pool.load_full();
    // Worker 0 is full on both ranks (engine says 8 of 8), worker 1 on rank 0 only.
    for r in 0..2 {
        snap.decodes[0].per_rank.capacity[r].observe(&report(8, None));
    }
    snap.decodes[1].per_rank.capacity[0].observe(&report(8, None));
    snap.decodes[1].per_rank.capacity[1].observe(&report(7, None));
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let ctx = PickCtx {
        need: Some(need(0)),
        ..PickCtx::default()
    };
    for kind in ALL_KINDS {
        let p = build(kind);
        for _ in 0..6 {
            let t = select(p.as_ref(), &snap, Role::Decode, &ctx, &mut rng)
                .unwrap()
                .target;
            assert_eq!((t.worker, t.rank), (WorkerId(1), 1), "{kind:?}");
        }
    }
    // Everything full: no pick. Without a need (capacity not checked): a pick.
    snap.decodes[1].per_rank.capacity[1].observe(&report(8, None));
    let p = build(PolicyKind::RoundRobin);
    assert!(select(p.as_ref(), &snap, Role::Decode, &ctx, &mut rng).is_none());
    assert!(select(
        p.as_ref(),
        &snap,
        Role::Decode,
        &PickCtx::default(),
        &mut rng
    )
    .is_some());
    // The override wins: 9 per rank leaves room.
    let roomy = PickCtx {
        need: Some(need(9)),
        ..PickCtx::default()
    };
    assert!(select(p.as_ref(), &snap, Role::Decode, &roomy, &mut rng).is_some());
}

/// With the replica count known, the remainder slots turn over all decode ranks in URL
/// order (the pool sets each rank's turn), not over each worker's DP ranks: two decodes of
/// DP 2 with 4 slots a rank and 5 replicas give each replica 3 or 4 slots in all (by DP
/// rank alone, two replicas got 2 and three got 4: the burst bench).
#[test]
fn remainder_slots_turn_over_every_decode_rank() {
    let pool = decodes(2, 2);
    let snap = pool.load();
    let mut per_replica = Vec::new();
    for i in 0..5u32 {
        let limits = Limits {
            override_per_rank: 4,
            learn_from_engine: false,
            replicas: 5,
            replica_index: Some(i),
            ..Limits::default()
        };
        let total: u64 = snap
            .decodes
            .iter()
            .flat_map(|w| w.per_rank.capacity.iter())
            .filter_map(|r| r.share(&limits))
            .sum();
        per_replica.push(total);
    }
    assert_eq!(per_replica.iter().sum::<u64>(), 16, "{per_replica:?}");
    assert!(
        per_replica.iter().all(|s| (3..=4).contains(s)),
        "{per_replica:?}"
    );
}
