//! Prefill admission by tokens on the request path (`[admission] prefill_backlog_max_secs`,
//! the state and its arithmetic are `pool::backlog`'s): which prefill ranks the pick may
//! take, and the hold a prefill leg keeps on its rank.
//!
//! The bound applies to the (worker, rank) the prefill leg will run on: the candidates are
//! narrowed to the ranks with room before the policy picks, and the rooms are then drawn to
//! map onto the rank picked (`room % dp == rank` in `modulo` mode, the rank named in
//! `pinned` mode: `super::room`), so the check and the compute are on one rank. When some
//! prefill could take the request but every one is over its bound, the pick fails with
//! [`OVER`] and the request waits in the admission queue like one waiting for a decode slot
//! (`super::capacity`), woken by a prefill leg ending or a prefill's load poll.
//!
//! A rank that has learned no pace yet is held to the mean pace of the candidates that
//! have one (`pool::backlog::Bound`), so a cold rank does not take a whole burst.
//!
//! Invariants: with the bound off (0) nothing is filtered and nothing allocated; with it on,
//! the candidates are copied only when some rank is over; a hold is taken for every leg
//! either way (its tokens and the pace it teaches feed `pdgate_prefill_backlog_seconds`).

use std::borrow::Cow;

use super::AttemptFailure;
use crate::config::AdmissionConfig;
use crate::error::{FailReason, Failure};
use crate::pool::backlog::{BacklogHold, Bound, HeldBack, RankBacklog};
use crate::pool::{Routable, Snapshot};
use crate::request::ParsedRequest;
use crate::types::{Role, WorkerId};

/// The failure a pick reports when prefills exist but every one is over its backlog
/// bound (an internal marker, like a full decode: the attempt waits on it).
pub(in crate::dispatch) const OVER: &str =
    "every eligible prefill rank has more than admission.prefill_backlog_max_secs of work queued";

/// What a request brings to a prefill rank, and the bound it is held to.
#[derive(Clone, Copy, Debug)]
pub(in crate::dispatch) struct PrefillNeed {
    /// Estimated prompt tokens (`ParsedRequest::prompt_tokens_estimate`).
    pub tokens: u64,
    /// One prompt instance: the prefill's answer reports its figures.
    pub single: bool,
    /// The bound (`max_secs` 0: off); its fallback pace is set by [`with_room`] from the
    /// candidates' learned paces.
    pub bound: Bound,
}

impl PrefillNeed {
    pub(in crate::dispatch) fn of(a: &AdmissionConfig, req: &ParsedRequest) -> PrefillNeed {
        PrefillNeed {
            tokens: req.prompt_tokens_estimate(),
            single: req.instances() == 1,
            bound: Bound {
                max_secs: a.prefill_backlog_max_secs,
                fallback_pace: None,
            },
        }
    }

    fn bounded(&self) -> bool {
        self.bound.max_secs > 0.0
    }

    fn rank(snap: &Snapshot, w: WorkerId, rank: u32) -> Option<&RankBacklog> {
        snap.worker(Role::Prefill, w)
            .and_then(|v| v.per_rank.backlog.get(rank as usize))
    }

    /// Whether `rank` of prefill `w` has room under the bound.
    fn admits(&self, snap: &Snapshot, w: WorkerId, rank: u32) -> bool {
        PrefillNeed::rank(snap, w, rank).is_none_or(|b| self.bound.admits(b.figures(), self.tokens))
    }
}

/// The mean learned pace of the ranks of `list` that have one (`None`: none has).
fn pool_pace(snap: &Snapshot, list: &[Routable]) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0u32);
    for r in list {
        for k in &r.ranks {
            if let Some(p) = PrefillNeed::rank(snap, r.worker, *k).and_then(RankBacklog::pace) {
                sum += p;
                n += 1;
            }
        }
    }
    (n > 0).then(|| sum / f64::from(n))
}

/// The prefill candidates `among` (else every routable prefill) narrowed to the ranks with
/// room under `need`'s bound: borrowed as they are when every rank has room (or the bound
/// is off); `Err` when some candidate outside `exclude` exists but none has room.
/// Sets `need`'s fallback pace (the candidates' mean) on the way.
pub(in crate::dispatch) fn with_room<'a>(
    snap: &'a Snapshot,
    among: Option<&'a [Routable]>,
    exclude: &[WorkerId],
    need: &mut PrefillNeed,
) -> Result<Option<Cow<'a, [Routable]>>, AttemptFailure> {
    if !need.bounded() {
        return Ok(among.map(Cow::Borrowed));
    }
    let list = among.unwrap_or_else(|| snap.routable(Role::Prefill));
    need.bound.fallback_pace = pool_pace(snap, list);
    let need = &*need;
    let eligible = || list.iter().filter(|r| !exclude.contains(&r.worker));
    let open = |r: &Routable| r.ranks.iter().all(|k| need.admits(snap, r.worker, *k));
    if eligible().all(open) {
        return Ok(among.map(Cow::Borrowed));
    }
    let kept: Vec<Routable> = eligible()
        .filter_map(|r| {
            let ranks: Vec<_> = r
                .ranks
                .iter()
                .copied()
                .filter(|k| need.admits(snap, r.worker, *k))
                .collect();
            (!ranks.is_empty()).then_some(Routable {
                worker: r.worker,
                ranks,
            })
        })
        .collect();
    if kept.is_empty() {
        return Err(over_failure());
    }
    Ok(Some(Cow::Owned(kept)))
}

/// The failure of a pick with every prefill over its bound.
pub(in crate::dispatch) fn over_failure() -> AttemptFailure {
    AttemptFailure::unblamed(Failure::new(FailReason::Overloaded, OVER))
}

/// While the request waits because every prefill rank is over (`full` is [`OVER`]), its
/// tokens counted as held back on a prefill of its model (`prev`, else a new count on the
/// first routable prefill of `model`), so the model's backlog signal sees what waits in
/// pdgate's queue; `None` while it waits for anything else.
pub(in crate::dispatch) fn held_back(
    prev: Option<HeldBack>,
    full: &AttemptFailure,
    snap: &Snapshot,
    model: Option<&str>,
    need: &PrefillNeed,
) -> Option<HeldBack> {
    if full.failure.message != OVER {
        return None;
    }
    prev.or_else(|| {
        let r = snap.routable_for(Role::Prefill, model).first()?;
        let w = snap.worker(Role::Prefill, r.worker)?;
        Some(HeldBack::new(&w.per_rank.backlog, need.tokens))
    })
}

/// The prefill leg's hold on its (worker, rank), or `None` when a request of this replica
/// took the rank's last room since the pick (the attempt then waits, as when over).
pub(in crate::dispatch) fn hold(
    c: &super::ChosenPair<'_>,
    need: &PrefillNeed,
    signal: &std::sync::Arc<crate::pool::CapacitySignal>,
) -> Option<BacklogHold> {
    BacklogHold::take(
        &c.prefill.per_rank.backlog,
        c.pair.prefill.rank,
        need.tokens,
        need.single,
        &need.bound,
        signal,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::backlog::BacklogHold;
    use crate::pool::Pool;
    use crate::upstream::parse_base_url;

    /// Two prefills of DP 2; rank (worker, rank) of `busy` holds a leg of 1500 estimated
    /// tokens, every rank has learned 1000 tokens a second unless `cold`.
    fn pool(busy: &[(u32, u32)], cold: &[(u32, u32)]) -> (Pool, Vec<BacklogHold>) {
        let pool = Pool::new();
        for i in 0..2 {
            let url = parse_base_url(&format!("http://127.0.0.1:{}", 900 + i)).expect("url");
            let id = pool.add_worker(Role::Prefill, url, None);
            pool.update_worker(Role::Prefill, id, |w| w.facts.dp_size = Some(2));
        }
        let snap = pool.load_full();
        let mut holds = Vec::new();
        for (w, view) in snap.prefills.iter().enumerate() {
            for (r, b) in view.per_rank.backlog.iter().enumerate() {
                let k = (w as u32, r as u32);
                if !cold.contains(&k) {
                    b.learn(1000, 0, 1_000_000, Some((1000, 0)));
                }
                if busy.contains(&k) {
                    let off = Bound::default();
                    holds.extend(BacklogHold::take(
                        &view.per_rank.backlog,
                        r as u32,
                        1500,
                        true,
                        &off,
                        pool.capacity_signal(),
                    ));
                }
            }
        }
        (pool, holds)
    }

    fn all() -> Vec<Routable> {
        (0..2)
            .map(|w| Routable {
                worker: WorkerId(w),
                ranks: vec![0, 1],
            })
            .collect()
    }

    #[test]
    fn the_candidates_are_the_ranks_under_the_bound() {
        type Ranks = Vec<(u32, Vec<u32>)>;
        // (busy ranks, cold ranks, bound, excluded, the candidates left: None = as given,
        // Some(empty) = every one over)
        type Keys = Vec<(u32, u32)>;
        type Row = (Keys, Keys, f64, Vec<u32>, Option<Ranks>);
        let table: Vec<Row> = vec![
            // Nothing busy: the list as it is.
            (vec![], vec![], 2.0, vec![], None),
            // 1.5 s on (0, 0): a 0.5 s prompt still fits a 2 s bound, not a 1.8 s one.
            (vec![(0, 0)], vec![], 2.0, vec![], None),
            (
                vec![(0, 0)],
                vec![],
                1.8,
                vec![],
                Some(vec![(0, vec![1]), (1, vec![0, 1])]),
            ),
            // A whole worker over: it leaves the list.
            (
                vec![(0, 0), (0, 1)],
                vec![],
                1.8,
                vec![],
                Some(vec![(1, vec![0, 1])]),
            ),
            // Every rank over: the request waits.
            (
                vec![(0, 0), (0, 1), (1, 0), (1, 1)],
                vec![],
                1.8,
                vec![],
                Some(vec![]),
            ),
            // Every rank left over, once the others are excluded.
            (vec![(0, 0), (0, 1)], vec![], 1.8, vec![1], Some(vec![])),
            // The bound off: nothing filtered.
            (
                vec![(0, 0), (0, 1), (1, 0), (1, 1)],
                vec![],
                0.0,
                vec![],
                None,
            ),
            // A cold rank is held to its pool's pace (1000 tokens a second) too.
            (
                vec![(0, 0), (0, 1), (1, 0), (1, 1)],
                vec![(1, 1)],
                1.8,
                vec![],
                Some(vec![]),
            ),
            // No pace anywhere: nothing is bounded.
            (
                vec![(0, 0), (0, 1), (1, 0), (1, 1)],
                vec![(0, 0), (0, 1), (1, 0), (1, 1)],
                1.8,
                vec![],
                None,
            ),
        ];
        let list = all();
        for (busy, cold, max_secs, excluded, want) in table {
            let (pool, _holds) = pool(&busy, &cold);
            let snap = pool.load_full();
            let exclude: Vec<WorkerId> = excluded.into_iter().map(WorkerId).collect();
            let mut need = PrefillNeed {
                tokens: 500,
                single: true,
                bound: Bound {
                    max_secs,
                    fallback_pace: None,
                },
            };
            let got = with_room(&snap, Some(&list), &exclude, &mut need);
            let got: Option<Ranks> = match got {
                Err(af) => {
                    assert!(super::super::capacity::is_full(&af), "waits in the queue");
                    Some(vec![])
                }
                Ok(Some(Cow::Borrowed(_))) | Ok(None) => None,
                Ok(Some(Cow::Owned(v))) => {
                    Some(v.into_iter().map(|r| (r.worker.0, r.ranks)).collect())
                }
            };
            assert_eq!(
                got, want,
                "busy {busy:?} cold {cold:?} bound {max_secs} excluding {exclude:?}"
            );
        }
    }
}
