//! Prefix affinity by consistent hashing with bounded loads (Mirrokni, Thorup and
//! Zadimoghaddam, "Consistent Hashing with Bounded Loads", SODA 2018), over (worker, DP
//! rank) members.
//!
//! Why: an engine's radix cache only helps when the turns of a conversation (same
//! `prefix_hash`) land where the previous turn's prefix is cached, but pure affinity lets
//! one hot key overload its owner. SGLang with DP attention keeps one radix cache per DP
//! rank (decodes too, with `--disaggregation-decode-enable-radix-cache`), so the unit of
//! affinity is a (worker, rank), not a worker: the ring's members are the candidates'
//! routable ranks (on a decode pick, only those with room for the request: a full rank is
//! not a member for this pick). Consistent hashing gives affinity that survives members
//! joining and leaving (only the keys of the changed member move; a worker whose DP size
//! grows only gains members); the load bound caps how far any rank can run above the
//! mean, spilling the excess to the next members clockwise, which are the same for every
//! replica, so spilled keys also keep a (secondary) affinity. A DP-k worker owns k members
//! and so about k times the keys of a DP-1 worker: in proportion to its caches.
//!
//! The ring: member (w, k) owns `vnodes` points `mix(seed + (v+1)·φ)`, v = 0..vnodes, with
//! `seed = fnv1a(url_w) + mix(k)` (a SplitMix64 stream; `mix(0) = 0`, so rank 0's points
//! are exactly the worker-level points of the ring this policy had before ranks: a fleet
//! without DP picks as it did). A request sits at `mix(prefix_hash)`. Walking clockwise
//! from the key meets each member first at its point with the smallest clockwise distance,
//! so the walk order over members is the order of `min_v (point − key) mod 2^64`. The whole
//! ring is therefore never built: each worker's sorted points per rank (a pure function of
//! its URL and the rank) are kept in an `ArcSwap`ed list keyed by URL, and
//! [`CacheAware::pick`] binary-searches each member's points for its distance (members ×
//! log2(vnodes) steps), then takes the nearest member whose load is within the bound. A
//! worker (or rank) not seen before has its points computed on the spot and published
//! with a compare-and-swap (`rcu`); the pick path never blocks on a lock and allocates
//! nothing once the points are cached. The list is bounded ([`MAX_CACHED`] workers); past
//! that it starts over.
//!
//! Load of a member = the rank's requests in flight from this replica plus the engine's
//! reported load on it (the per-rank terms of [`super::power_of_two::load`]). Bound =
//! ceil(c × (total load + 1) / n) + s over the n members (s = `cache_aware_slack`: at low
//! load the relative term is one or two requests, and a spilled turn recomputes its
//! conversation elsewhere, dearer than waiting behind a request on its own rank); a member
//! is eligible when its load ≤ bound, so after taking the request a rank is at most one
//! above the bound.
//!
//! The policy returns the (candidate, rank) pair ([`Chosen`]); `policy::select` sends the
//! request to that rank. The key is the only input that says where a prefix is cached; a
//! future cache index (the engines' KV events) could replace it by returning the member
//! whose cache holds the longest prefix, with the same [`Chosen`] and the same bound.
//!
//! Invariants:
//! - Replica independence: the choice depends only on the candidates' URLs, routable ranks,
//!   per-rank loads (and room), `c`, `vnodes` and the key; never on candidate order,
//!   process, build or a random seed (FNV-1a and SplitMix64 are fixed functions; ties
//!   broken by URL hash, rank, then URL).
//! - With c ≥ 1 some member is always within the bound (the mean is below it); if none
//!   were, the least loaded member is taken, so the pick never exceeds what any other
//!   member would.
//! - The rank returned is one of the candidate's routable ranks (with room, when the pick
//!   has a need).
//! - No prefix hash: falls back to power of two choices over workers (no rank named), at
//!   no extra cost.
//! - Returns an index `< cands.len()`.
//! - `spilled` is set exactly when the member taken is not the key's own (the nearest
//!   routable rank of the candidates, load and room aside): the request spilled off a full
//!   or hot rank. A worker with no rank with room is not a candidate, so a key whose whole
//!   worker is full counts no spill.

use std::borrow::Cow;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rand::RngCore;

use super::power_of_two::{load, PowerOfTwo};
use super::{has_room, Candidate, Chosen, PickCtx, Policy};
use crate::config::PolicyConfig;
use crate::pool::capacity::Need;
use crate::types::{fnv1a, DpRank};

/// SplitMix64's finaliser: a fixed bijective mixer.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Position of a member's virtual node `v` on the ring, from the member's seed
/// ([`member_seed`]; a worker's URL hash for its rank 0).
pub fn ring_point(seed: u64, v: u32) -> u64 {
    mix64(seed.wrapping_add(u64::from(v).wrapping_add(1).wrapping_mul(GOLDEN)))
}

/// The ring seed of rank `rank` of the worker whose URL hashes to `url_hash`: the URL hash
/// itself for rank 0 (`mix64(0) = 0`), so a DP-1 worker keeps its worker-level points.
pub fn member_seed(url_hash: u64, rank: DpRank) -> u64 {
    url_hash.wrapping_add(mix64(u64::from(rank)))
}

/// Position of a request key on the ring.
pub fn key_point(prefix_hash: u64) -> u64 {
    mix64(prefix_hash)
}

/// Most workers whose points are kept (configured workers are far fewer).
pub const MAX_CACHED: usize = 4096;

/// One member's sorted ring points.
type Points = Arc<[u64]>;

/// A worker's ring identity: its URL's hash and, per rank 0..len, its sorted points.
#[derive(Clone, Debug)]
struct RingEntry {
    url: Box<str>,
    hash: u64,
    ranks: Arc<[Points]>,
}

/// Sorted by URL.
type PointCache = Vec<RingEntry>;

#[derive(Debug)]
pub struct CacheAware {
    factor: f64,
    /// Requests a member may hold above the relative bound (`policy.cache_aware_slack`).
    slack: u32,
    vnodes: u32,
    points: ArcSwap<PointCache>,
}

impl Default for CacheAware {
    fn default() -> Self {
        CacheAware::from_config(&PolicyConfig::default())
    }
}

/// The candidate's ring members: its routable ranks, with room for `need` when set.
fn members<'a>(c: &'a Candidate<'_>, need: Option<&'a Need>) -> impl Iterator<Item = DpRank> + 'a {
    c.ranks
        .iter()
        .copied()
        .filter(move |k| need.is_none() || has_room(c.worker, *k, need))
}

/// A member's load: in flight plus engine-reported on that rank (saturating). A candidate
/// with one routable rank carries exactly that rank's figures already.
fn member_load(c: &Candidate<'_>, rank: DpRank) -> u64 {
    if c.ranks.len() == 1 {
        load(c)
    } else {
        c.worker
            .in_flight(rank)
            .saturating_add(c.worker.engine_load(rank))
    }
}

/// Whether a member at `key` on the candidate whose URL is `url` comes before `held` (the
/// candidate index and key held so far): the smaller key, then the smaller URL.
fn ahead<K: Ord>(held: &Option<(usize, K)>, key: &K, url: &str, cands: &[Candidate<'_>]) -> bool {
    match held {
        None => true,
        Some((j, h)) => key < h || (key == h && url < cands[*j].worker.shared.url.as_str()),
    }
}

impl CacheAware {
    /// `factor` below 1 or not finite is taken as 1; `vnodes` at least 1; no slack.
    pub fn new(factor: f64, vnodes: u32) -> CacheAware {
        let factor = if factor.is_finite() && factor >= 1.0 {
            factor
        } else {
            1.0
        };
        CacheAware {
            factor,
            slack: 0,
            vnodes: vnodes.max(1),
            points: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// The same with `slack` requests above the relative bound.
    pub fn with_slack(self, slack: u32) -> CacheAware {
        CacheAware { slack, ..self }
    }

    pub fn from_config(cfg: &PolicyConfig) -> CacheAware {
        CacheAware::new(cfg.cache_aware_balance_factor, cfg.cache_aware_vnodes)
            .with_slack(cfg.cache_aware_slack)
    }

    /// ceil(c × (total + 1) / n) + slack: the most load a member may have and still take
    /// one more.
    pub fn bound(&self, total: u64, n: usize) -> u64 {
        let n = n.max(1) as f64;
        // Float to int casts saturate; the value is finite and non-negative.
        ((self.factor * (total as f64 + 1.0) / n).ceil() as u64)
            .saturating_add(u64::from(self.slack))
    }

    /// Clockwise distance from `key` to the member's nearest virtual node, from scratch
    /// (the definition; the pick path uses the cached, sorted points).
    pub fn distance_direct(&self, seed: u64, key: u64) -> u64 {
        (0..self.vnodes)
            .map(|v| ring_point(seed, v).wrapping_sub(key))
            .min()
            .unwrap_or(u64::MAX)
    }

    /// The same distance from the member's sorted points: the first point at or after
    /// `key`, else (wrapping) the first point of the ring.
    fn distance_sorted(points: &[u64], key: u64) -> u64 {
        let i = points.partition_point(|p| *p < key);
        points
            .get(i)
            .or(points.first())
            .map_or(u64::MAX, |p| p.wrapping_sub(key))
    }

    /// A member's sorted points.
    fn member_points(&self, url_hash: u64, rank: DpRank) -> Points {
        let seed = member_seed(url_hash, rank);
        let mut v: Vec<u64> = (0..self.vnodes).map(|i| ring_point(seed, i)).collect();
        v.sort_unstable();
        v.into()
    }

    /// A worker's ring entry with the points of ranks `0..ranks` at least, computed and
    /// published when not cached yet.
    fn add_entry(&self, url: &str, ranks: usize, old: Option<&RingEntry>) -> RingEntry {
        let hash = fnv1a(url.as_bytes());
        let kept = old.map_or(&[][..], |e| &e.ranks[..]);
        let all: Vec<Points> = (0..ranks.max(1))
            .map(|k| match kept.get(k) {
                Some(p) => p.clone(),
                None => self.member_points(hash, k as DpRank),
            })
            .collect();
        let entry = RingEntry {
            url: url.into(),
            hash,
            ranks: all.into(),
        };
        self.points.rcu(|cur| {
            let mut next: PointCache = if cur.len() >= MAX_CACHED {
                Vec::new()
            } else {
                cur.as_ref().clone()
            };
            match next.binary_search_by(|e| (*e.url).cmp(url)) {
                Ok(at) if next[at].ranks.len() < entry.ranks.len() => next[at] = entry.clone(),
                Ok(_) => {}
                Err(at) => next.insert(at, entry.clone()),
            }
            next
        });
        entry
    }

    /// The worker's ring entry, holding at least ranks `0..ranks`.
    fn entry<'c>(&self, cache: &'c PointCache, url: &str, ranks: usize) -> Cow<'c, RingEntry> {
        match cache.binary_search_by(|e| (*e.url).cmp(url)) {
            Ok(i) if cache[i].ranks.len() >= ranks => Cow::Borrowed(&cache[i]),
            Ok(i) => Cow::Owned(self.add_entry(url, ranks, Some(&cache[i]))),
            Err(_) => Cow::Owned(self.add_entry(url, ranks, None)),
        }
    }

    /// The worker's URL hash and the clockwise distance from `key` to the nearest virtual
    /// node of its rank `rank`.
    #[cfg(test)]
    fn distance(&self, cache: &PointCache, url: &str, rank: DpRank, key: u64) -> (u64, u64) {
        let e = self.entry(cache, url, rank as usize + 1);
        let d = e
            .ranks
            .get(rank as usize)
            .map_or(u64::MAX, |p| Self::distance_sorted(p, key));
        (e.hash, d)
    }

    /// The member the key maps to, honouring the load bound.
    fn walk(&self, cands: &[Candidate<'_>], need: Option<&Need>, prefix_hash: u64) -> Chosen {
        let key = key_point(prefix_hash);
        // First pass: how many members, and their total load.
        let (mut n, mut total) = (0usize, 0u64);
        for c in cands {
            for k in members(c, need) {
                n += 1;
                total = total.saturating_add(member_load(c, k));
            }
        }
        let bound = self.bound(total, n);
        let cache = self.points.load();
        // (within bound?, load if not, distance, url hash, rank) – smallest wins, then URL.
        type Rank = (bool, u64, u64, u64, DpRank);
        let mut best: Option<(usize, Rank)> = None;
        // The key's own member, load and room aside: (distance, url hash, rank), then URL.
        let mut home: Option<(usize, (u64, u64, DpRank))> = None;
        for (i, c) in cands.iter().enumerate() {
            let url = c.worker.shared.url.as_str();
            let top = c.ranks.iter().max().map_or(1, |k| *k as usize + 1);
            let e = self.entry(&cache, url, top);
            for &k in c.ranks.iter() {
                let d = e
                    .ranks
                    .get(k as usize)
                    .map_or(u64::MAX, |p| Self::distance_sorted(p, key));
                let at = (d, e.hash, k);
                if ahead(&home, &at, url, cands) {
                    home = Some((i, at));
                }
                if need.is_some() && !has_room(c.worker, k, need) {
                    continue;
                }
                let l = member_load(c, k);
                let over = l > bound;
                let rank = (over, if over { l } else { 0 }, d, e.hash, k);
                if ahead(&best, &rank, url, cands) {
                    best = Some((i, rank));
                }
            }
        }
        match best {
            Some((i, r)) => Chosen {
                index: i,
                rank: Some(r.4),
                spilled: home.is_some_and(|(j, h)| (j, h.2) != (i, r.4)),
            },
            // No member (select lists only candidates with a rank with room): any.
            None => Chosen::worker(0),
        }
    }
}

impl Policy for CacheAware {
    fn name(&self) -> &'static str {
        "cache_aware"
    }
    fn wants_prefix(&self) -> bool {
        true
    }
    fn pick(&self, cands: &[Candidate<'_>], ctx: &PickCtx<'_>, rng: &mut dyn RngCore) -> Chosen {
        match (ctx.prefix_hash, cands) {
            // One candidate with one rank: nothing to choose.
            (Some(_), [c]) if c.ranks.len() <= 1 => Chosen::worker(0),
            (Some(key), _) => self.walk(cands, ctx.need.as_ref(), key),
            (None, _) => Chosen::worker(PowerOfTwo::choose(cands, rng)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::{Pool, Snapshot};
    use crate::types::Role;
    use crate::upstream::parse_base_url;
    use proptest::prelude::*;
    use rand::SeedableRng;

    fn url(i: usize) -> String {
        format!("http://10.1.{}.{}:30001", i / 200, i % 200)
    }

    fn pool_of(urls: &[String]) -> Pool {
        let pool = Pool::new();
        for u in urls {
            pool.add_worker(Role::Decode, parse_base_url(u).unwrap(), None);
        }
        pool
    }

    fn cands<'a>(snap: &'a Snapshot, loads: &[u64]) -> Vec<Candidate<'a>> {
        snap.decodes
            .iter()
            .enumerate()
            .map(|(i, w)| Candidate {
                worker: w,
                ranks: &[0],
                in_flight: loads.get(i).copied().unwrap_or(0),
                engine_load: 0,
            })
            .collect()
    }

    fn pick(p: &CacheAware, c: &[Candidate<'_>], key: u64) -> usize {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0);
        let ctx = PickCtx {
            exclude: &[],
            prefix_hash: Some(key),
            need: None,
            among: None,
        };
        p.pick(c, &ctx, &mut rng).index
    }

    #[test]
    fn hash_functions_are_pinned() {
        // Changing any of these remaps every key in every deployed replica.
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692_161d_100b_05e5);
        assert_eq!(ring_point(0, 0), mix64(GOLDEN));
        let h = fnv1a(b"http://10.0.0.1:30000");
        assert_eq!(h, 0x10d6_2349_fd6b_e93c);
        assert_eq!(ring_point(h, 0), 0xd9ae_66a6_a7be_d8b0);
        assert_eq!(ring_point(h, 7), 0xf07c_fe7b_d565_32eb);
        assert_eq!(key_point(fnv1a(b"pin")), 0xfb64_e3cb_d862_11a4);
        // Rank 0 is the worker-level ring; other ranks are seeded from the URL and the rank.
        assert_eq!(member_seed(h, 0), h);
        assert_eq!(member_seed(h, 1), h.wrapping_add(0x5692_161d_100b_05e5));
    }

    #[test]
    fn independent_replicas_agree() {
        let urls: Vec<String> = (0..7).map(url).collect();
        let mut rev = urls.clone();
        rev.reverse();
        let (a, b) = (pool_of(&urls), pool_of(&rev));
        let (sa, sb) = (a.load_full(), b.load_full());
        // Two instances built separately, candidates in a different order, same loads by URL.
        let (pa, pb) = (
            CacheAware::default(),
            CacheAware::from_config(&PolicyConfig::default()),
        );
        let la: Vec<u64> = (0..7).map(|i| (i as u64 * 7) % 5).collect();
        let mut lb = la.clone();
        lb.reverse();
        let (ca, cb) = (cands(&sa, &la), cands(&sb, &lb));
        let mut used = std::collections::HashSet::new();
        for k in 0..2000u64 {
            let key = fnv1a(format!("conversation {k}").as_bytes());
            let x = ca[pick(&pa, &ca, key)].worker.shared.url.as_str();
            let y = cb[pick(&pb, &cb, key)].worker.shared.url.as_str();
            assert_eq!(x, y, "key {k}");
            used.insert(x.to_string());
        }
        assert!(used.len() >= 5, "keys should spread: {used:?}");
    }

    #[test]
    fn no_key_falls_back_to_power_of_two() {
        let urls: Vec<String> = (0..2).map(url).collect();
        let pool = pool_of(&urls);
        let snap = pool.load_full();
        let c = cands(&snap, &[5, 1]);
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..20 {
            assert_eq!(
                CacheAware::default()
                    .pick(&c, &PickCtx::default(), &mut rng)
                    .index,
                1
            );
        }
        assert_eq!(pick(&CacheAware::default(), &c[..1], 9), 0);
    }

    #[test]
    fn bound_formula() {
        let p = CacheAware::new(1.25, 10);
        assert_eq!(p.bound(0, 4), 1);
        assert_eq!(p.bound(4, 4), 2);
        assert_eq!(p.bound(99, 4), 32);
        assert_eq!(p.bound(u64::MAX, 1), u64::MAX);
        assert_eq!(p.bound(3, 0), 5);
        assert_eq!(CacheAware::new(f64::NAN, 0).bound(9, 10), 1);
    }

    proptest! {
        #[test]
        fn cached_points_give_the_ring_distance(url in "http://[a-z0-9.]{1,20}:[0-9]{1,5}", keys in proptest::collection::vec(any::<u64>(), 1..20), vnodes in 1u32..200) {
            let p = CacheAware::new(1.25, vnodes);
            let h = fnv1a(url.as_bytes());
            for key in keys.into_iter().chain([0, u64::MAX, ring_point(h, 0)]) {
                let cache = p.points.load();
                prop_assert_eq!(p.distance(&cache, &url, 0, key), (h, p.distance_direct(h, key)));
                prop_assert_eq!(p.distance(&cache, &url, 3, key), (h, p.distance_direct(member_seed(h, 3), key)));
            }
            prop_assert_eq!(p.points.load().len(), 1);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn bounded_load_holds(loads in proptest::collection::vec(0u64..40, 1..12), key: u64, c in 1.0f64..3.0) {
            let urls: Vec<String> = (0..loads.len()).map(url).collect();
            let pool = pool_of(&urls);
            let snap = pool.load_full();
            let cs = cands(&snap, &loads);
            let p = CacheAware::new(c, 16);
            let i = pick(&p, &cs, key);
            prop_assert!(i < cs.len());
            let bound = p.bound(loads.iter().sum(), loads.len());
            if loads.iter().any(|l| *l <= bound) {
                prop_assert!(loads[i] <= bound, "picked {} > bound {}", loads[i], bound);
            } else {
                prop_assert_eq!(loads[i], *loads.iter().min().unwrap());
            }
            // A spill goes where the key would go if the overloaded owners were absent.
            let kept: Vec<Candidate<'_>> = cands(&snap, &loads)
                .into_iter()
                .filter(|c| c.in_flight <= bound)
                .collect();
            if !kept.is_empty() && kept.len() < cs.len() {
                let zero: Vec<Candidate<'_>> = kept
                    .iter()
                    .map(|c| Candidate { worker: c.worker, ranks: c.ranks, in_flight: 0, engine_load: 0 })
                    .collect();
                let j = pick(&p, &zero, key);
                prop_assert_eq!(zero[j].worker.shared.url.as_str(), cs[i].worker.shared.url.as_str());
            }
        }

        #[test]
        fn removing_one_worker_moves_only_its_keys(n in 2usize..12, gone in 0usize..12, seed: u64) {
            let gone = gone % n;
            let urls: Vec<String> = (0..n).map(url).collect();
            let all = pool_of(&urls);
            let rest: Vec<String> = urls.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, u)| u.clone()).collect();
            let fewer = pool_of(&rest);
            let (sa, sb) = (all.load_full(), fewer.load_full());
            let (ca, cb) = (cands(&sa, &[]), cands(&sb, &[]));
            let p = CacheAware::default();
            let keys = 1000u64;
            let mut moved = 0u64;
            for k in 0..keys {
                let key = mix64(seed ^ k);
                let before = ca[pick(&p, &ca, key)].worker.shared.url.as_str();
                let after = cb[pick(&p, &cb, key)].worker.shared.url.as_str();
                if before != after {
                    moved += 1;
                    // Only keys of the removed worker move.
                    prop_assert_eq!(before, urls[gone].as_str());
                } else {
                    prop_assert_ne!(before, urls[gone].as_str());
                }
            }
            let frac = moved as f64 / keys as f64;
            prop_assert!(frac <= 1.6 / n as f64 + 0.04, "moved {frac} of keys with n = {n}");
            prop_assert!(frac >= 0.4 / n as f64 - 0.04, "moved {frac} of keys with n = {n}");
        }
    }
}
