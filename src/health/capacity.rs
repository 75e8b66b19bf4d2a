//! The capacity half of the engine load poll: from the same `/v1/loads` (or `/get_load`)
//! body the load poller reads, each decode DP rank's running window (running + waiting),
//! its capacity (`max_running_requests` per entry), its KV figures (`num_used_tokens`,
//! `num_total_tokens`, `max_total_num_tokens`) and its pre-allocation queue
//! (`disaggregation.decode_prealloc_queue_reqs`, which `num_waiting_reqs` already counts;
//! a rank showing more than this replica just sent it takes no new request, see
//! `pool::capacity`), stored in place into the worker's
//! [`crate::pool::RankCapacity`] atomics; and the capacity `/server_info` reports
//! (`internal_states[i].effective_max_running_requests_per_dp`), read once at start.
//!
//! Why here: the poller owns the engine's figures (one writer per worker, off the request
//! path); `policy` reads them and the request path reserves against them
//! (`pool::capacity`).
//!
//! Invariants: parsing never panics (unknown shapes and bad numbers are ignored); a poll
//! that failed, or a worker that is unhealthy, stores "nothing reported" (the running
//! window falls back to pdgate's own reservations; a learned capacity is kept); every
//! store wakes the requests waiting for a slot, since the window may have opened.
//! The top-level `max_running_requests` of `/server_info` is the engine-wide flag (often
//! null) and is not used.

use serde_json::Value;

use super::report::{count, per_rank};

use crate::pool::capacity::Reported;
use crate::pool::Pool;
use crate::types::{Role, WorkerId};

fn entry(e: &Value) -> Reported {
    let waiting = count(e.get("num_waiting_reqs"));
    let busy = match count(e.get("num_running_reqs")) {
        Some(r) => Some(r.saturating_add(waiting.unwrap_or(0))),
        // Mid generation: num_reqs is running + waiting already.
        None => count(e.get("num_reqs")),
    };
    // Outstanding KV: used + pending where reported (newest), else used, else the mid
    // generation's num_tokens.
    let tokens = count(e.get("num_total_tokens"))
        .or_else(|| count(e.get("num_used_tokens")))
        .or_else(|| count(e.get("num_tokens")));
    Reported {
        busy,
        max_running: count(e.get("max_running_requests")).filter(|c| *c > 0),
        tokens,
        max_tokens: count(e.get("max_total_num_tokens")).filter(|c| *c > 0),
        // Newest generation, decode engines, unless `include=` left the section out:
        // absent (or not a count) is unknown, never 0.
        prealloc: count(
            e.get("disaggregation")
                .and_then(|d| d.get("decode_prealloc_queue_reqs")),
        ),
        waiting,
    }
}

/// Per-rank figures of a load body (`{"loads": [...]}`, a bare list, or one entry); empty
/// when the body has none (e.g. the old `{"load": n}`).
pub fn parse(body: &[u8]) -> Vec<(usize, Reported)> {
    per_rank(body, entry)
}

/// Stores one poll's figures (`None`: the poll failed) into the worker's ranks.
pub fn store(pool: &Pool, role: Role, id: WorkerId, figures: Option<&[(usize, Reported)]>) {
    let snap = pool.load();
    let Some(view) = snap.worker(role, id) else {
        return;
    };
    for (r, cap) in view.per_rank.capacity.iter().enumerate() {
        let rep = figures
            .and_then(|f| f.iter().find(|(k, _)| *k == r))
            .map(|(_, rep)| *rep)
            .unwrap_or_default();
        cap.observe_with(&rep, rand::random());
    }
    pool.capacity_signal().wake();
}

/// Seeds each rank's capacity from `/server_info`'s `internal_states`.
pub fn seed(pool: &Pool, role: Role, id: WorkerId, per_dp: &[Option<u64>]) {
    let snap = pool.load();
    let Some(view) = snap.worker(role, id) else {
        return;
    };
    for (cap, c) in view.per_rank.capacity.iter().zip(per_dp) {
        if let Some(c) = c {
            cap.set_engine_cap(*c);
        }
    }
    pool.capacity_signal().wake();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_generation_s_capacity_figures() {
        let r = |busy, max_running, tokens, max_tokens| Reported {
            busy,
            max_running,
            tokens,
            max_tokens,
            prealloc: None,
            waiting: None,
        };
        let table: &[(&str, Vec<(usize, Reported)>)] = &[
            (
                r#"{"loads": [{"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 90, "num_total_tokens": 100, "max_total_num_tokens": 1000, "max_running_requests": 8},
                              {"dp_rank": 0, "num_running_reqs": 0, "max_running_requests": null}]}"#,
                vec![
                    (
                        1,
                        Reported {
                            waiting: Some(2),
                            ..r(Some(5), Some(8), Some(100), Some(1000))
                        },
                    ),
                    (0, r(Some(0), None, None, None)),
                ],
            ),
            (
                r#"[{"num_reqs": 4, "num_tokens": 7}]"#,
                vec![(0, r(Some(4), None, Some(7), None))],
            ),
            (
                r#"{"dp_rank": 2, "num_running_reqs": 1.0, "max_running_requests": 0}"#,
                vec![(2, r(Some(1), None, None, None))],
            ),
            (r#"{"load": 9}"#, vec![]),
            (r#"{"loads": "x"}"#, vec![]),
            ("<html>", vec![]),
            (
                r#"[{"num_running_reqs": -3, "max_running_requests": "4"}]"#,
                vec![(0, r(None, None, None, None))],
            ),
        ];
        for (body, want) in table {
            assert_eq!(&parse(body.as_bytes()), want, "{body}");
        }
    }

    #[test]
    fn reads_the_decode_pre_allocation_queue() {
        // SGLang's /v1/loads entry (`LoadSnapshot.to_dict`) on a decode, as the simulator
        // reports it too; `num_waiting_reqs` counts the queue already.
        let real = r#"{"loads": [{"dp_rank": 0, "timestamp": 1.5, "num_running_reqs": 4, "num_waiting_reqs": 3,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": 80, "num_total_tokens": 80,
            "max_total_num_tokens": 1000, "max_running_requests": 4, "token_usage": 0.08,
            "gen_throughput": 0.0, "cache_hit_rate": 0.0, "utilization": 0.08,
            "disaggregation": {"mode": "decode", "prefill_bootstrap_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 2,
                "decode_transfer_queue_reqs": 1, "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}},
            {"dp_rank": 1, "num_running_reqs": 1, "num_waiting_reqs": 0,
             "disaggregation": {"mode": "decode", "decode_prealloc_queue_reqs": 0}}]}"#;
        // (body, the queue per reported rank)
        type Queues = Vec<(usize, Option<u64>)>;
        let table: &[(&str, Queues)] = &[
            (real, vec![(0, Some(2)), (1, Some(0))]),
            // `include=core`, or an engine without the section: unknown, not 0.
            (
                r#"{"loads": [{"dp_rank": 0, "num_running_reqs": 4, "num_waiting_reqs": 3}]}"#,
                vec![(0, None)],
            ),
            (
                r#"[{"num_running_reqs": 1, "disaggregation": {"mode": "decode"}}]"#,
                vec![(0, None)],
            ),
            // The mid generation has no such figure.
            (r#"[{"dp_rank": 1, "num_reqs": 4}]"#, vec![(1, None)]),
            // Malformed: negative, a string, a section that is not an object.
            (
                r#"[{"num_running_reqs": 1, "disaggregation": {"decode_prealloc_queue_reqs": -1}},
                   {"num_running_reqs": 1, "disaggregation": {"decode_prealloc_queue_reqs": "2"}},
                   {"num_running_reqs": 1, "disaggregation": 3},
                   {"num_running_reqs": 1, "disaggregation": {"decode_prealloc_queue_reqs": 1.0}}]"#,
                vec![(0, None), (1, None), (2, None), (3, Some(1))],
            ),
        ];
        for (body, want) in table {
            let got: Vec<_> = parse(body.as_bytes())
                .into_iter()
                .map(|(rank, r)| (rank, r.prealloc))
                .collect();
            assert_eq!(&got, want, "{body}");
        }
        assert_eq!(
            parse(real.as_bytes()).first().map(|(_, r)| r.busy),
            Some(Some(7)),
            "running + waiting, the queue inside waiting, not added twice"
        );
    }
}
