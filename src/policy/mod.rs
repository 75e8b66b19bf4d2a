//! Selection policies: pure functions over a pool [`Snapshot`] that pick one routable
//! worker, and optionally its DP rank ([`Chosen`]); when the policy names no rank,
//! [`select`] takes that worker's least-loaded routable DP rank (the room is made to match
//! the rank either way, see `dispatch::attempt::room`). The randomness is injected (`rng`),
//! so a policy is deterministic under a seeded generator. Kinds: `random`, `round_robin`,
//! `power_of_two` (load-aware) and `cache_aware` (prefix affinity with bounded loads per
//! (worker, DP rank): an engine keeps one prefix cache per rank); see POLICIES.md.
//!
//! Why a policy may name the rank: with DP attention each rank has its own radix cache, so
//! affinity that stops at the worker lands a conversation on a different rank's cache turn
//! after turn. The rank a policy names is honoured only while it is one of the candidate's
//! routable ranks with room (else the least-loaded rule applies), so a policy cannot break
//! the invariant below. A future cache index (KV events) plugs in the same way: it returns
//! the candidate and the rank whose cache holds the prefix.
//!
//! Decode capacity (`pool::capacity`): with `PickCtx::need` set, a worker is a candidate
//! only while one of its routable ranks has room for the request, and the rank is picked
//! among those, by outstanding work: the KV tokens in flight where the engine reports
//! them (its last poll corrected by this replica's reservations since), then requests in
//! flight, then the engine's reported load. Without token figures the order is as before.
//!
//! Invariant: [`select`] only ever returns a (worker, rank) listed routable in the snapshot
//! (within `ctx.among` when it is set: a model's workers, a prefill's handoff group),
//! never a worker in `ctx.exclude` (workers that already failed this request), and never a
//! worker whose circuit is half-open with its one trial already taken. A pick of a
//! half-open worker carries its [`TrialGuard`]: whoever holds the pick holds the trial,
//! and the trial is free again when the pick is dropped.

mod cache_aware;
mod power_of_two;
mod random;
mod round_robin;

use rand::{Rng, RngCore};

use crate::config::{PolicyConfig, PolicyKind};
use crate::pool::capacity::Need;
use crate::pool::{BreakerState, Routable, Snapshot, TrialGuard, WorkerView};
use crate::types::{DpRank, Role, Target, WorkerId};

pub use cache_aware::CacheAware;
pub use power_of_two::{load, PowerOfTwo};
pub use random::Random;
pub use round_robin::RoundRobin;

/// What a policy may know about the request.
#[derive(Clone, Copy, Debug, Default)]
pub struct PickCtx<'a> {
    /// Workers that already failed this request.
    pub exclude: &'a [WorkerId],
    /// Hash of the prompt's prefix (see `request::ParsedRequest::prefix_hash`).
    pub prefix_hash: Option<u64>,
    /// What the request needs of a decode rank (decode picks only; `None`: capacity is
    /// not checked).
    pub need: Option<Need>,
    /// The routable workers to pick among (a model's, or a prefill's handoff group);
    /// `None`: every routable worker of the role.
    pub among: Option<&'a [Routable]>,
}

/// One eligible worker as a policy sees it.
#[derive(Debug)]
pub struct Candidate<'a> {
    pub worker: &'a WorkerView,
    /// Its routable DP ranks (never empty).
    pub ranks: &'a [DpRank],
    /// Requests pdgate has in flight on those ranks.
    pub in_flight: u64,
    /// The engine's own reported load on those ranks (0 when not polled).
    pub engine_load: u64,
}

/// What a policy picked: a candidate, and the DP rank on it when the policy cares which.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chosen {
    /// Index into the candidates.
    pub index: usize,
    /// One of the candidate's routable ranks (with room, on a decode pick); `None`: the
    /// least-loaded rule of [`select`] chooses.
    pub rank: Option<DpRank>,
    /// The policy placed the request off its key's own (worker, rank) (`cache_aware`
    /// spilling a hot or full rank): counted on the rank it went to
    /// (`pdgate_affinity_spills_total`).
    pub spilled: bool,
}

impl Chosen {
    /// The candidate `index`, its rank left to [`select`].
    pub fn worker(index: usize) -> Chosen {
        Chosen {
            index,
            rank: None,
            spilled: false,
        }
    }
}

pub trait Policy: Send + Sync {
    fn name(&self) -> &'static str;
    /// Whether the policy reads `PickCtx::prefix_hash` (it is only computed then).
    fn wants_prefix(&self) -> bool {
        false
    }
    /// Picks one of `cands` (never empty), and the rank on it if the policy chooses ranks.
    fn pick(&self, cands: &[Candidate<'_>], ctx: &PickCtx<'_>, rng: &mut dyn RngCore) -> Chosen;
}

/// A policy with the default `[policy]` settings (see [`build_with`]).
pub fn build(kind: PolicyKind) -> Box<dyn Policy> {
    build_with(kind, &PolicyConfig::default())
}

/// A policy configured by `[policy]` (`cache_aware_*` keys).
pub fn build_with(kind: PolicyKind, cfg: &PolicyConfig) -> Box<dyn Policy> {
    match kind {
        PolicyKind::Random => Box::new(Random),
        PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
        PolicyKind::PowerOfTwo => Box::new(PowerOfTwo),
        PolicyKind::CacheAware => Box::new(CacheAware::from_config(cfg)),
    }
}

/// Every policy kind, for tests and the simulator.
pub const ALL_KINDS: [PolicyKind; 4] = [
    PolicyKind::Random,
    PolicyKind::RoundRobin,
    PolicyKind::PowerOfTwo,
    PolicyKind::CacheAware,
];

fn candidate<'a>(snap: &'a Snapshot, role: Role, r: &'a Routable) -> Option<Candidate<'a>> {
    let worker = snap.worker(role, r.worker)?;
    // Saturating: engine-reported loads are whatever an engine says.
    let sum = |f: &dyn Fn(DpRank) -> u64| r.ranks.iter().fold(0u64, |t, k| t.saturating_add(f(*k)));
    let in_flight = sum(&|k| worker.in_flight(k));
    let engine_load = sum(&|k| worker.engine_load(k));
    Some(Candidate {
        worker,
        ranks: &r.ranks,
        in_flight,
        engine_load,
    })
}

/// A picked target, holding the half-open trial of its worker when it is one.
#[derive(Debug)]
pub struct Pick {
    pub target: Target,
    /// Held until the request's verdict on this worker (or its end without one).
    pub trial: Option<TrialGuard>,
}

/// Picks a (worker, rank) of `role`: the policy picks the worker and maybe its rank (kept
/// while it is routable and has room), else the worker's routable rank with the least
/// outstanding work ([`rank_for`]).
pub fn select(
    policy: &dyn Policy,
    snap: &Snapshot,
    role: Role,
    ctx: &PickCtx<'_>,
    rng: &mut dyn RngCore,
) -> Option<Pick> {
    // On the stack for fleets of up to 16 workers per role (no allocation per request).
    let mut cands: smallvec::SmallVec<[Candidate<'_>; 16]> = ctx
        .among
        .unwrap_or_else(|| snap.routable(role))
        .iter()
        .filter(|r| !ctx.exclude.contains(&r.worker))
        .filter_map(|r| candidate(snap, role, r))
        .filter(|c| {
            !(c.worker.shared.breaker.state() == BreakerState::HalfOpen
                && c.worker.shared.breaker.trial_taken())
        })
        .filter(|c| {
            c.ranks
                .iter()
                .any(|k| has_room(c.worker, *k, ctx.need.as_ref()))
        })
        .collect();
    while !cands.is_empty() {
        let choice = policy.pick(&cands, ctx, rng);
        let i = choice.index.min(cands.len() - 1);
        let c = &cands[i];
        let mut trial = None;
        if c.worker.shared.breaker.state() == BreakerState::HalfOpen {
            // This request is the half-open worker's one trial, unless another request
            // took it since the candidates were listed: then pick among the others.
            trial = c.worker.shared.breaker.take_trial();
            if trial.is_none() {
                cands.remove(i);
                continue;
            }
        }
        let need = ctx.need.as_ref();
        let rank = match choice.rank {
            Some(k) if c.ranks.contains(&k) && has_room(c.worker, k, need) => k,
            _ => rank_for(c, need, rng),
        };
        if choice.spilled {
            c.worker.per_rank.tally.spilled_in(rank);
        }
        let target = Target {
            worker: c.worker.shared.id,
            rank,
        };
        return Some(Pick { target, trial });
    }
    None
}

/// Whether `rank` of `w` has room for `need` (always, without a need).
fn has_room(w: &WorkerView, rank: DpRank, need: Option<&Need>) -> bool {
    match (need, w.capacity(rank)) {
        (Some(n), Some(c)) => c.has_room(n),
        _ => true,
    }
}

/// The routable rank with the fewest requests in flight (then engine load), random among ties.
pub fn least_loaded_rank(c: &Candidate<'_>, rng: &mut dyn RngCore) -> DpRank {
    rank_for(c, None, rng)
}

/// Among the routable ranks with room for `need`, the one with the least outstanding work:
/// KV tokens in flight (0 where the engine reports none), then requests in flight, then
/// the engine's load; random among ties.
pub fn rank_for(c: &Candidate<'_>, need: Option<&Need>, rng: &mut dyn RngCore) -> DpRank {
    let w = c.worker;
    let load = |k: DpRank| {
        let tokens = w.capacity(k).and_then(|r| r.tokens()).unwrap_or(0);
        (tokens, w.in_flight(k), w.engine_load(k))
    };
    let open = |k: &DpRank| has_room(w, *k, need);
    let best = c
        .ranks
        .iter()
        .copied()
        .filter(|k| open(k))
        .map(load)
        .min()
        .unwrap_or((0, 0, 0));
    // Two passes over the (few) ranks instead of collecting the ties.
    let ties = || {
        c.ranks
            .iter()
            .copied()
            .filter(|k| open(k) && load(*k) == best)
    };
    match ties().count() {
        0 => c.ranks.first().copied().unwrap_or(0),
        1 => ties().next().unwrap_or(0),
        n => ties().nth(rng.random_range(0..n)).unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{LoadGuard, Pool};
    use crate::upstream::parse_base_url;
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn pool(healthy: &[bool]) -> Pool {
        let pool = Pool::new();
        for (i, h) in healthy.iter().enumerate() {
            let id = pool.add_worker(
                Role::Decode,
                parse_base_url(&format!("http://127.0.0.1:{}", 1000 + i)).unwrap(),
                None,
            );
            pool.update_worker(Role::Decode, id, |w| {
                w.facts.healthy = *h;
                w.facts.dp_size = Some(2);
            });
        }
        pool
    }

    proptest! {
        #[test]
        fn never_picks_unroutable_or_excluded(healthy in proptest::collection::vec(any::<bool>(), 0..6), excl in 0u32..7, seed: u64, busy in proptest::collection::vec(0usize..12, 0..8)) {
            let pool = pool(&healthy);
            let snap = pool.load_full();
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            // Some load, so load-aware policies do not just take the first candidate.
            let _guards: Vec<LoadGuard> = busy
                .iter()
                .filter_map(|b| snap.decodes.get(b / 2).map(|w| LoadGuard::new(w, (b % 2) as DpRank)))
                .collect();
            let exclude = [WorkerId(excl)];
            let prefix_hash = (seed % 3 != 0).then_some(seed);
            let ctx = PickCtx { exclude: &exclude, prefix_hash, need: None, among: None };
            for kind in ALL_KINDS {
                let p = build(kind);
                prop_assert_eq!(p.wants_prefix(), kind == PolicyKind::CacheAware);
                for _ in 0..8 {
                    let got = select(p.as_ref(), &snap, Role::Decode, &ctx, &mut rng).map(|p| p.target);
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
    fn engine_load_sums_saturate() {
        let pool = pool(&[true, true]);
        let snap = pool.load_full();
        for w in &snap.decodes {
            for c in w.per_rank.engine_load.iter() {
                c.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let r = &snap.decode_routable[0];
        let c = candidate(&snap, Role::Decode, r).unwrap();
        assert_eq!(c.engine_load, u64::MAX);
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        for kind in ALL_KINDS {
            let p = build(kind);
            let ctx = PickCtx {
                exclude: &[],
                prefix_hash: Some(7),
                need: None,
                among: None,
            };
            assert!(select(p.as_ref(), &snap, Role::Decode, &ctx, &mut rng).is_some());
        }
    }

    #[test]
    fn round_robin_cycles_workers_and_ranks_follow_load() {
        let pool = pool(&[true, true]);
        let snap = pool.load_full();
        let p = RoundRobin::default();
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let ctx = PickCtx::default();
        let a = select(&p, &snap, Role::Decode, &ctx, &mut rng)
            .unwrap()
            .target;
        let b = select(&p, &snap, Role::Decode, &ctx, &mut rng)
            .unwrap()
            .target;
        assert_ne!(a.worker, b.worker);
        // Within a worker the least-loaded rank wins.
        let w = snap.worker(Role::Decode, WorkerId(0)).unwrap();
        let _g = LoadGuard::new(w, 0);
        for _ in 0..4 {
            let t = select(&p, &snap, Role::Decode, &ctx, &mut rng)
                .unwrap()
                .target;
            if t.worker == WorkerId(0) {
                assert_eq!(t.rank, 1);
            }
        }
    }
}

#[cfg(test)]
mod capacity_tests;
#[cfg(test)]
mod ring_tests;
