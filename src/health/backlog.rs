//! The prefill half of the engine load poll: from the same `/v1/loads` body the load
//! poller reads, each prefill DP rank's `num_waiting_uncached_tokens` (the prompt tokens
//! queued for compute that the rank's prefix cache lacks: SGLang's
//! `managers/load_snapshot.py`), stored in place into the worker's
//! [`crate::pool::backlog::RankBacklog`] atomics, which bound what the request path sends
//! a prefill rank (`[admission] prefill_backlog_max_secs`).
//!
//! Invariants: parsing never panics (unknown shapes and bad numbers read as "not
//! reported"); a rank the body does not report, a failed poll, an unhealthy worker and a
//! poll turned off store "not reported" (the backlog falls back to this replica's own legs,
//! never a stale queue); every store wakes the requests waiting in the admission queue,
//! since a rank's backlog may have shrunk. The mid and old generations (`/get_load`) have
//! no such figure.

use super::report::{count, per_rank};
use crate::pool::Pool;
use crate::types::{Role, WorkerId};

/// Per reported rank, its queued uncached tokens (`None`: the entry has no such figure).
pub fn parse(body: &[u8]) -> Vec<(usize, Option<u64>)> {
    per_rank(body, |e| count(e.get("num_waiting_uncached_tokens")))
}

/// Stores one poll's body (`None`: the poll failed, or polling is off) into the prefill's
/// ranks.
pub fn store(pool: &Pool, id: WorkerId, body: Option<&[u8]>) {
    let snap = pool.load();
    let Some(view) = snap.worker(Role::Prefill, id) else {
        return;
    };
    let figures = body.map(parse).unwrap_or_default();
    for (r, b) in view.per_rank.backlog.iter().enumerate() {
        let w = figures.iter().find(|(k, _)| *k == r).and_then(|(_, w)| *w);
        b.observe(w);
    }
    pool.capacity_signal().wake();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_queued_uncached_tokens_per_rank() {
        // (body, the queued uncached tokens per reported rank)
        type PerRank = Vec<(usize, Option<u64>)>;
        let table: &[(&str, PerRank)] = &[
            // SGLang's /v1/loads entry on a prefill, as the simulator reports it too.
            (
                r#"{"loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 2,
                    "num_waiting_uncached_tokens": 1400, "disaggregation": {"mode": "prefill"}},
                   {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 0,
                    "num_waiting_uncached_tokens": 0}]}"#,
                vec![(0, Some(1400)), (1, Some(0))],
            ),
            // Ranks out of order, a bare list, a float.
            (
                r#"[{"dp_rank": 1, "num_running_reqs": 0, "num_waiting_uncached_tokens": 7.0},
                    {"dp_rank": 0, "num_running_reqs": 0}]"#,
                vec![(1, Some(7)), (0, None)],
            ),
            // The mid generation has no such figure.
            (r#"[{"num_reqs": 4, "num_tokens": 9}]"#, vec![(0, None)]),
            // One entry; malformed figures are "not reported".
            (
                r#"{"dp_rank": 2, "num_running_reqs": 1, "num_waiting_uncached_tokens": -5}"#,
                vec![(2, None)],
            ),
            (
                r#"[{"num_running_reqs": 1, "num_waiting_uncached_tokens": "12"}]"#,
                vec![(0, None)],
            ),
            (r#"{"load": 9}"#, vec![]),
            ("<html>", vec![]),
        ];
        for (body, want) in table {
            assert_eq!(&parse(body.as_bytes()), want, "{body}");
        }
    }

    #[test]
    fn a_poll_stores_every_rank_and_a_failed_one_forgets() {
        let pool = Pool::new();
        let url = crate::upstream::parse_base_url("http://127.0.0.1:9").expect("url");
        let id = pool.add_worker(Role::Prefill, url, None);
        pool.update_worker(Role::Prefill, id, |w| w.facts.dp_size = Some(2));
        let body = br#"{"loads": [{"dp_rank": 1, "num_running_reqs": 1, "num_waiting_uncached_tokens": 300}]}"#;
        store(&pool, id, Some(body));
        let snap = pool.load();
        let w = snap.worker(Role::Prefill, id).expect("worker");
        let waiting = |r: usize| w.per_rank.backlog[r].figures().engine_waiting;
        assert_eq!((waiting(0), waiting(1)), (None, Some(300)));
        store(&pool, id, None);
        assert_eq!((waiting(0), waiting(1)), (None, None));
    }
}
