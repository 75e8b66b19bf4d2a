//! `cache_aware` over (worker, DP rank) members, through [`select`]: the pick is the ring's
//! answer (checked against a whole ring built the slow way), always a routable rank with
//! room, the same in every replica, within the load bound for a hot key, and on a fleet
//! without DP exactly the worker-level ring's pick.

use super::cache_aware::{key_point, member_seed, ring_point};
use super::*;
use crate::pool::capacity::{Limits, Need, Reported};
use crate::pool::{LoadGuard, Pool};
use crate::types::fnv1a;
use crate::upstream::parse_base_url;
use proptest::prelude::*;
use rand::SeedableRng;

fn url(i: usize) -> String {
    format!("http://10.2.{}.{}:30000", i / 200, i % 200)
}

/// Routable decodes with these DP sizes (worker i at [`url`]`(i)`); `reversed`: added in
/// the opposite order, so ids and candidate order differ.
fn fleet(dps: &[u32], reversed: bool) -> Pool {
    let pool = Pool::new();
    let mut order: Vec<usize> = (0..dps.len()).collect();
    if reversed {
        order.reverse();
    }
    for i in order {
        let id = pool.add_worker(Role::Decode, parse_base_url(&url(i)).unwrap(), None);
        pool.update_worker(Role::Decode, id, |w| {
            w.facts.healthy = true;
            w.facts.dp_size = Some(dps[i]);
        });
    }
    pool
}

fn view(snap: &Snapshot, i: usize) -> &WorkerView {
    let u = url(i);
    snap.decodes
        .iter()
        .find(|w| w.shared.url.as_str() == u || w.shared.url.as_str() == format!("{u}/"))
        .unwrap()
}

fn need() -> Need {
    Need {
        limits: Limits {
            override_per_rank: 0,
            learn_from_engine: true,
            kv_bound: true,
            ..Limits::default()
        },
        tokens: 10,
        slots: 1,
    }
}

/// The rank reports `busy` of 8 running slots (8: full).
fn busy(w: &WorkerView, rank: usize, busy: u64) {
    w.per_rank.capacity[rank].observe(&Reported {
        busy: Some(busy),
        max_running: Some(8),
        tokens: None,
        max_tokens: None,
        prealloc: None,
        waiting: None,
    });
}

fn ctx<'a>(key: u64, need: Option<Need>) -> PickCtx<'a> {
    PickCtx {
        exclude: &[],
        prefix_hash: Some(key),
        need,
        among: None,
    }
}

/// (url, rank) of the pick.
fn pick_at(p: &CacheAware, snap: &Snapshot, ctx: &PickCtx<'_>) -> Option<(String, DpRank)> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(0);
    let t = select(p, snap, Role::Decode, ctx, &mut rng)?.target;
    let w = snap.worker(Role::Decode, t.worker)?;
    Some((w.shared.url.to_string(), t.rank))
}

/// The definition, the slow way: every member's every point on one sorted ring, walked
/// clockwise from the key to the first member within the bound (else the least loaded).
fn ring_oracle(
    p_factor: f64,
    slack: u32,
    vnodes: u32,
    snap: &Snapshot,
    key: u64,
    need: Option<&Need>,
) -> Option<(String, DpRank)> {
    let mut members = Vec::new(); // (url, hash, rank, load)
    for w in &snap.decodes {
        let r = snap
            .decode_routable
            .iter()
            .find(|r| r.worker == w.shared.id);
        for k in r.map_or(&[][..], |r| &r.ranks[..]) {
            if need.is_some_and(|n| !w.capacity(*k).is_none_or(|c| c.has_room(n))) {
                continue;
            }
            let url = w.shared.url.to_string();
            let load = w.in_flight(*k).saturating_add(w.engine_load(*k));
            members.push((url.clone(), fnv1a(url.as_bytes()), *k, load));
        }
    }
    if members.is_empty() {
        return None;
    }
    let total = members.iter().fold(0u64, |t, m| t.saturating_add(m.3));
    let bound = CacheAware::new(p_factor, vnodes)
        .with_slack(slack)
        .bound(total, members.len());
    let key = key_point(key);
    let mut ring = Vec::new(); // (clockwise distance, hash, rank, url, member)
    for (i, m) in members.iter().enumerate() {
        for v in 0..vnodes {
            let d = ring_point(member_seed(m.1, m.2), v).wrapping_sub(key);
            ring.push((d, m.1, m.2, m.0.clone(), i));
        }
    }
    ring.sort();
    let first = ring.iter().map(|e| &members[e.4]).find(|m| m.3 <= bound);
    let m = first.or_else(|| {
        // Least loaded, then nearest.
        ring.iter().map(|e| &members[e.4]).min_by_key(|m| m.3)
    })?;
    Some((m.0.clone(), m.2))
}

/// The key's own member among the candidates (workers with a routable rank with room for
/// `need`): the nearest of all their routable ranks, whatever their load or room.
fn home_oracle(snap: &Snapshot, key: u64, need: &Need) -> Option<(String, DpRank)> {
    let key = key_point(key);
    // ((distance, url hash, rank, url), the member)
    type Near = ((u64, u64, DpRank, String), (String, DpRank));
    let mut best: Option<Near> = None;
    for w in &snap.decodes {
        let Some(r) = snap
            .decode_routable
            .iter()
            .find(|r| r.worker == w.shared.id)
        else {
            continue;
        };
        if !r
            .ranks
            .iter()
            .any(|k| w.capacity(*k).is_none_or(|c| c.has_room(need)))
        {
            continue;
        }
        let url = w.shared.url.to_string();
        let h = fnv1a(url.as_bytes());
        for k in &r.ranks {
            let d = (0..32)
                .map(|v| ring_point(member_seed(h, *k), v).wrapping_sub(key))
                .min()
                .unwrap_or(u64::MAX);
            let at = (d, h, *k, url.clone());
            if best.as_ref().is_none_or(|(b, _)| at < *b) {
                best = Some((at, (url.clone(), *k)));
            }
        }
    }
    best.map(|(_, m)| m)
}

#[test]
fn the_pick_follows_the_ring_per_rank() {
    // (DP sizes, in flight per (worker, rank), full (worker, rank)s, what must hold)
    type Row = (
        &'static [u32],
        &'static [(usize, usize, usize)],
        &'static [(usize, usize)],
    );
    let rows: &[Row] = &[
        (&[1, 1, 1], &[], &[]),
        (&[4], &[], &[]),
        (&[4, 4], &[(0, 1, 1), (1, 2, 1)], &[]),
        (&[2, 8, 1], &[(1, 3, 5), (1, 4, 2)], &[]),
        (&[4, 4], &[], &[(0, 0), (0, 1), (1, 3)]),
        (&[4, 2], &[(0, 2, 3)], &[(1, 0), (1, 1)]),
    ];
    let p = CacheAware::default();
    for (dps, loads, full) in rows {
        let pool = fleet(dps, false);
        let snap = pool.load_full();
        let _g: Vec<LoadGuard> = loads
            .iter()
            .flat_map(|(w, k, n)| (0..*n).map(move |_| (*w, *k)))
            .map(|(w, k)| LoadGuard::new(view(&snap, w), k as DpRank))
            .collect();
        for (w, k) in full.iter() {
            busy(view(&snap, *w), *k, 8);
        }
        let mut seen = std::collections::HashSet::new();
        for key in 0..200u64 {
            let key = fnv1a(format!("conversation {key}").as_bytes());
            for need in [None, Some(need())] {
                let got = pick_at(&p, &snap, &ctx(key, need));
                let want = ring_oracle(1.25, 1, 100, &snap, key, need.as_ref());
                assert_eq!(got, want, "{dps:?} {loads:?} {full:?} key {key:x}");
                if need.is_some() {
                    let (u, k) = got.unwrap();
                    let i = (0..dps.len()).find(|i| u.starts_with(&url(*i))).unwrap();
                    assert!(!full.contains(&(i, k as usize)), "a full rank was picked");
                    seen.insert((i, k));
                }
            }
        }
        // Keys spread over every member with room and within the bound.
        let n = dps.iter().map(|d| *d as usize).sum::<usize>() - full.len();
        let total = loads.iter().map(|l| l.2 as u64).sum();
        let over = loads
            .iter()
            .filter(|l| l.2 as u64 > p.bound(total, n))
            .count();
        assert_eq!(seen.len(), n - over, "{dps:?}: {seen:?}");
    }
}

#[test]
fn the_policy_rank_wins_over_the_least_loaded_one() {
    // (slack, the most requests in flight on the key's rank while it still takes the key:
    // the largest l with l ≤ ceil(1.25·(l+1)/4) + slack, the other ranks idle)
    for (slack, kept) in [(0u32, 1usize), (1, 3), (3, 6)] {
        let pool = fleet(&[4], false);
        let snap = pool.load_full();
        let p = CacheAware::new(1.25, 100).with_slack(slack);
        let key = fnv1a(b"a conversation");
        let (_, k) = pick_at(&p, &snap, &ctx(key, None)).unwrap();
        // Up to `kept` requests in flight on that rank: within the bound, so the key stays
        // although the other ranks are idle.
        assert!(
            kept as u64 <= p.bound(kept as u64, 4) && kept as u64 + 1 > p.bound(kept as u64 + 1, 4)
        );
        let mut guards: Vec<LoadGuard> = Vec::new();
        for _ in 0..kept {
            guards.push(LoadGuard::new(&snap.decodes[0], k));
            assert_eq!(
                pick_at(&p, &snap, &ctx(key, None)).unwrap().1,
                k,
                "slack {slack}"
            );
        }
        // One more: over the bound: the next rank clockwise, not the first free.
        guards.push(LoadGuard::new(&snap.decodes[0], k));
        let spilled = pick_at(&p, &snap, &ctx(key, None)).unwrap().1;
        assert_ne!(spilled, k, "slack {slack}");
        assert_eq!(
            Some(spilled),
            ring_oracle(1.25, slack, 100, &snap, key, None).map(|m| m.1)
        );
        // A full rank is skipped on a decode pick the same way.
        drop(guards);
        busy(&snap.decodes[0], k as usize, 8);
        let got = pick_at(&p, &snap, &ctx(key, Some(need()))).unwrap().1;
        assert_ne!(got, k);
        assert_eq!(
            Some(got),
            ring_oracle(1.25, slack, 100, &snap, key, Some(&need())).map(|m| m.1)
        );
    }
}

/// The worker-level ring as it was before ranks, over [`Candidate`]s (the reference for
/// fleets without DP).
fn worker_ring(p: &CacheAware, cands: &[Candidate<'_>], prefix_hash: u64) -> usize {
    if cands.len() <= 1 {
        return 0;
    }
    let key = key_point(prefix_hash);
    let total = cands.iter().fold(0u64, |t, c| t.saturating_add(load(c)));
    let bound = p.bound(total, cands.len());
    let mut best: Option<(usize, (bool, u64, u64, u64))> = None;
    for (i, c) in cands.iter().enumerate() {
        let url = c.worker.shared.url.as_str();
        let h = fnv1a(url.as_bytes());
        let d = p.distance_direct(h, key);
        let l = load(c);
        let over = l > bound;
        let rank = (over, if over { l } else { 0 }, d, h);
        let better = match &best {
            None => true,
            Some((j, r)) => rank < *r || (rank == *r && url < cands[*j].worker.shared.url.as_str()),
        };
        if better {
            best = Some((i, rank));
        }
    }
    best.map_or(0, |(i, _)| i)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn picks_a_routable_rank_with_room(
        dps in proptest::collection::vec(1u32..5, 1..6),
        full in proptest::collection::vec(any::<bool>(), 24),
        loads in proptest::collection::vec((0usize..6, 0usize..4), 0..16),
        engine in proptest::collection::vec(0u64..6, 24),
        key: u64,
        c in 1.0f64..3.0,
    ) {
        let pool = fleet(&dps, false);
        let snap = pool.load_full();
        let mut slot = 0;
        for (i, w) in snap.decodes.iter().enumerate() {
            for k in 0..dps[i] as usize {
                busy(w, k, if full[slot % 24] { 8 } else { 0 });
                w.per_rank.engine_load[k].store(engine[slot % 24], std::sync::atomic::Ordering::Relaxed);
                slot += 1;
            }
        }
        let _g: Vec<LoadGuard> = loads
            .iter()
            .filter_map(|(w, k)| snap.decodes.get(*w).filter(|v| (*k as u32) < v.effective_dp()).map(|v| LoadGuard::new(v, *k as DpRank)))
            .collect();
        let p = CacheAware::new(c, 32);
        let n = need();
        let spills = |snap: &Snapshot| -> u64 {
            snap.decodes.iter().flat_map(|w| w.per_rank.tally.read()).map(|c| c.spills).sum()
        };
        let before = spills(&snap);
        let got = pick_at(&p, &snap, &ctx(key, Some(n)));
        prop_assert_eq!(&got, &ring_oracle(c, 0, 32, &snap, key, Some(&n)));
        // A spill is counted exactly when the pick is not the key's own member: the
        // nearest routable rank, load and room aside, of the workers that are candidates
        // (a worker without a rank with room is not one).
        let home = home_oracle(&snap, key, &n);
        let spilled = got.is_some() && got != home;
        prop_assert_eq!(spills(&snap) - before, u64::from(spilled));
        match got {
            Some((u, k)) => {
                let w = snap.decodes.iter().find(|w| w.shared.url.to_string() == u).unwrap();
                let r = snap.decode_routable.iter().find(|r| r.worker == w.shared.id).unwrap();
                prop_assert!(r.ranks.contains(&k));
                prop_assert!(w.capacity(k).unwrap().has_room(&n));
            }
            None => prop_assert!(snap.decodes.iter().all(|w| (0..w.effective_dp()).all(|k| !w.capacity(k).unwrap().has_room(&n)))),
        }
    }

    #[test]
    fn replicas_agree_whatever_the_order(
        dps in proptest::collection::vec(1u32..5, 1..7),
        loads in proptest::collection::vec((0usize..7, 0usize..4), 0..20),
        keys in proptest::collection::vec(any::<u64>(), 1..16),
    ) {
        // Two replicas: workers added in opposite orders (other ids, other candidate
        // order), separate policy instances, one of them warmed up in another order.
        let (a, b) = (fleet(&dps, false), fleet(&dps, true));
        let (sa, sb) = (a.load_full(), b.load_full());
        let mut guards = Vec::new();
        for (w, k) in &loads {
            if *w < dps.len() && (*k as u32) < dps[*w] {
                guards.push(LoadGuard::new(view(&sa, *w), *k as DpRank));
                guards.push(LoadGuard::new(view(&sb, *w), *k as DpRank));
            }
        }
        let (pa, pb) = (CacheAware::default(), CacheAware::default());
        for key in keys.iter().rev() {
            let _ = pick_at(&pb, &sb, &ctx(*key, None));
        }
        for key in &keys {
            prop_assert_eq!(pick_at(&pa, &sa, &ctx(*key, None)), pick_at(&pb, &sb, &ctx(*key, None)));
            prop_assert_eq!(pick_at(&pa, &sa, &ctx(*key, Some(need()))), pick_at(&pb, &sb, &ctx(*key, Some(need()))));
        }
    }

    #[test]
    fn a_hot_key_stays_within_the_bound(
        dps in proptest::collection::vec(1u32..5, 1..6),
        key: u64,
        c in 1.0f64..3.0,
        picks in 1usize..80,
    ) {
        let pool = fleet(&dps, false);
        let snap = pool.load_full();
        let p = CacheAware::new(c, 32);
        let n: usize = dps.iter().map(|d| *d as usize).sum();
        let mut guards = Vec::new();
        let mut used = std::collections::HashSet::new();
        for _ in 0..picks {
            let (u, k) = pick_at(&p, &snap, &ctx(key, None)).unwrap();
            let w = snap.decodes.iter().find(|w| w.shared.url.to_string() == u).unwrap();
            guards.push(LoadGuard::new(w, k));
            used.insert((u, k));
            let total = guards.len() as u64;
            let bound = p.bound(total, n) + 1;
            for w in &snap.decodes {
                for k in 0..w.effective_dp() {
                    prop_assert!(w.in_flight(k) <= bound, "rank load {} > {} after {} picks", w.in_flight(k), bound, total);
                }
            }
        }
        // A hot key spills once its rank is past the bound.
        if n >= 2 && picks as f64 > c * (picks as f64 + 1.0) / n as f64 + 2.0 {
            prop_assert!(used.len() >= 2, "{used:?}");
        }
    }

    #[test]
    fn without_dp_the_worker_ring_picks(
        loads in proptest::collection::vec((0u64..30, 0u64..30), 1..12),
        keys in proptest::collection::vec(any::<u64>(), 1..12),
        c in 1.0f64..3.0,
        vnodes in 1u32..160,
    ) {
        let pool = fleet(&vec![1; loads.len()], false);
        let snap = pool.load_full();
        let cands: Vec<Candidate<'_>> = snap
            .decodes
            .iter()
            .zip(&loads)
            .map(|(w, (f, e))| Candidate { worker: w, ranks: &[0], in_flight: *f, engine_load: *e })
            .collect();
        let p = CacheAware::new(c, vnodes);
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        for key in keys {
            let got = p.pick(&cands, &ctx(key, None), &mut rng);
            prop_assert_eq!(got.index, worker_ring(&p, &cands, key));
            prop_assert!(got.rank.is_none_or(|k| k == 0));
        }
    }
}
