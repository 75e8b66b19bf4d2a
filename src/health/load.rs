//! The engine load poller: one task per worker that reads the engine's own load and
//! stores running + waiting requests per DP rank into the worker's `engine_load` atomics,
//! which load-aware policies add to pdgate's in-flight count (see `policy::load`). For a
//! decode, the same body also feeds its capacity state (`super::capacity`); for a prefill,
//! its ranks' queued uncached tokens (`super::backlog`).
//!
//! Why: pdgate's in-flight counters only see this replica's requests; the engine sees
//! every replica's, plus its queues. SGLang reported load in three generations (spec
//! §6.7), all handled here:
//! - newest: `GET /v1/loads`, per-DP entries `{dp_rank, num_running_reqs,
//!   num_waiting_reqs, ...}` in a `{"loads": [...]}` envelope or a bare list;
//! - mid: `GET /get_load`, a list of `{dp_rank, num_reqs, num_waiting_reqs, ...}` where
//!   `num_reqs` already counts running + waiting;
//! - old: `GET /get_load` answering `{"load": n}` for the whole engine, spread evenly over
//!   the ranks (all of it on rank 0 when DP is 1).
//!
//! The poller tries `/v1/loads` first and falls back to `/get_load`, then remembers which
//! endpoint answered; it probes again from the top when that endpoint stops answering
//! with a usable body.
//!
//! Invariants:
//! - No snapshot rebuild per poll: the current `Arc<[AtomicU64]>` is read from
//!   `pool.load()` and stored into in place (a DP-size change swaps the array, and the
//!   next poll writes the new one).
//! - A rank the engine did not report, and every rank after a failed poll or while the
//!   worker is unhealthy, reads 0: no information means only pdgate's own in-flight count
//!   is used, never a stale queue that would starve a worker.
//! - Parsing never panics: unknown shapes, negative or fractional numbers and ranks
//!   outside the worker's DP size are ignored or clamped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::report::count;

use crate::config::LiveConfig;
use crate::pool::Pool;
use crate::types::{Role, WorkerId};
use crate::upstream::{BaseUrl, Upstream};

/// Which load endpoint an engine answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Generation {
    /// Not known yet: try `/v1/loads`, then `/get_load`.
    Unknown,
    /// `GET /v1/loads` (newest).
    Loads,
    /// `GET /get_load` (mid: a per-rank list; old: `{"load": n}`).
    GetLoad,
}

impl Generation {
    pub fn path(self) -> &'static str {
        match self {
            Generation::Unknown | Generation::Loads => "/v1/loads",
            Generation::GetLoad => "/get_load",
        }
    }
}

/// A parsed load report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Report {
    /// (DP rank, running + waiting) per entry; ranks may repeat or be missing.
    PerRank(Vec<(usize, u64)>),
    /// One number for the whole engine (old `{"load": n}`).
    Total(u64),
}

/// Running + waiting of one per-rank entry, `None` when it has neither shape.
fn entry_load(e: &Value) -> Option<u64> {
    let waiting = || count(e.get("num_waiting_reqs")).unwrap_or(0);
    if let Some(running) = count(e.get("num_running_reqs")) {
        return Some(running.saturating_add(waiting()));
    }
    // Mid generation: num_reqs is running + waiting already.
    if let Some(n) = count(e.get("num_reqs")) {
        return Some(n);
    }
    count(e.get("load"))
}

/// Parses any of the three generations' bodies; `None` when it is none of them.
pub fn parse(body: &[u8]) -> Option<Report> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let list = match &v {
        Value::Array(a) => a,
        Value::Object(o) => match o.get("loads") {
            Some(Value::Array(a)) => a,
            _ => {
                if o.contains_key("num_running_reqs") || o.contains_key("num_reqs") {
                    // A single per-rank object.
                    return Some(Report::PerRank(vec![(rank_of(&v, 0), entry_load(&v)?)]));
                }
                return count(o.get("load")).map(Report::Total);
            }
        },
        _ => return None,
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, e) in list.iter().enumerate() {
        if let Some(l) = entry_load(e) {
            out.push((rank_of(e, i), l));
        }
    }
    if out.is_empty() && !list.is_empty() {
        return None;
    }
    Some(Report::PerRank(out))
}

fn rank_of(e: &Value, pos: usize) -> usize {
    count(e.get("dp_rank"))
        .and_then(|r| usize::try_from(r).ok())
        .unwrap_or(pos)
}

/// The report as one value per rank for a worker with `dp` ranks.
pub fn per_rank(report: &Report, dp: usize) -> Vec<u64> {
    let dp = dp.max(1);
    let mut out = vec![0u64; dp];
    match report {
        Report::PerRank(entries) => {
            for (rank, l) in entries {
                if let Some(slot) = out.get_mut(*rank) {
                    *slot = slot.saturating_add(*l);
                }
            }
        }
        Report::Total(total) => {
            let (each, rest) = (total / dp as u64, (total % dp as u64) as usize);
            for (r, slot) in out.iter_mut().enumerate() {
                *slot = each + u64::from(r < rest);
            }
        }
    }
    out
}

/// What one endpoint said.
enum Answer {
    /// The report and the body it came from (the capacity figures are read from it too).
    Usable(Report, bytes::Bytes),
    /// Connection failed or timed out: says nothing about the generation.
    Unreachable,
    /// Answered, but not with a load report (404, error body, unknown shape).
    NotThisOne,
}

async fn ask(up: &Upstream, url: &BaseUrl, g: Generation, timeout: Duration) -> Answer {
    match up.get(url, g.path(), timeout).await {
        Ok((status, body)) if status.is_success() => match parse(&body) {
            Some(r) => Answer::Usable(r, body),
            None => Answer::NotThisOne,
        },
        Ok(_) => Answer::NotThisOne,
        Err(_) => Answer::Unreachable,
    }
}

/// One poll: asks the remembered endpoint, else probes `/v1/loads` then `/get_load`;
/// updates `gen` to the endpoint that answered (`Unknown` when none did).
pub async fn poll_once(
    up: &Upstream,
    url: &BaseUrl,
    gen: &mut Generation,
    timeout: Duration,
) -> Option<Report> {
    poll_once_body(up, url, gen, timeout).await.map(|(r, _)| r)
}

/// [`poll_once`], also returning the body the report came from.
pub async fn poll_once_body(
    up: &Upstream,
    url: &BaseUrl,
    gen: &mut Generation,
    timeout: Duration,
) -> Option<(Report, bytes::Bytes)> {
    let known = *gen;
    if known != Generation::Unknown {
        match ask(up, url, known, timeout).await {
            Answer::Usable(r, b) => return Some((r, b)),
            Answer::Unreachable => return None,
            Answer::NotThisOne => {}
        }
    }
    for g in [Generation::Loads, Generation::GetLoad] {
        if g == known {
            continue;
        }
        if let Answer::Usable(r, b) = ask(up, url, g, timeout).await {
            tracing::debug!(worker_url = %url, endpoint = g.path(), "engine load endpoint");
            *gen = g;
            return Some((r, b));
        }
    }
    *gen = Generation::Unknown;
    None
}

/// Stores a report (or zeros) into the worker's current `engine_load` slots.
pub fn store(pool: &Pool, role: Role, id: WorkerId, report: Option<&Report>) {
    let snap = pool.load();
    let Some(view) = snap.worker(role, id) else {
        return;
    };
    let slots = &view.per_rank.engine_load;
    let values = report.map(|r| per_rank(r, slots.len()));
    for (r, slot) in slots.iter().enumerate() {
        let v = values.as_ref().and_then(|v| v.get(r)).copied().unwrap_or(0);
        slot.store(v, Ordering::Relaxed);
    }
}

/// How often a worker's poller looks at the live config while polling is off (no engine
/// traffic: it only notices a reload that turns polling on).
const OFF_RECHECK: Duration = Duration::from_secs(1);

/// The shortest gap between two polls of one engine, when requests ask for early ones.
const EARLY_GAP_MIN: Duration = Duration::from_millis(100);

/// Starts the load poller of one worker; it ends when the worker leaves the pool. Each
/// poll reads `policy.load_poll_interval_ms` from the live config, so a reload that turns
/// polling on or off, or changes its pace, applies to existing workers too. While off,
/// the worker's engine-load slots read 0.
pub fn spawn(
    pool: Arc<Pool>,
    up: Upstream,
    live: LiveConfig,
    role: Role,
    id: WorkerId,
    url: BaseUrl,
) {
    let p2 = pool.clone();
    p2.spawn_task(role, id, async move {
        let mut gen = Generation::Unknown;
        let mut holds_report = false;
        loop {
            let (every, timeout) = {
                let cfg = live.load();
                (
                    cfg.policy.load_poll_interval(),
                    cfg.bootstrap.http_timeout(),
                )
            };
            let Some(every) = every else {
                if holds_report {
                    // Turned off by a reload: no stale queue figures stay behind.
                    store(&pool, role, id, None);
                    match role {
                        Role::Decode => super::capacity::store(&pool, role, id, None),
                        Role::Prefill => super::backlog::store(&pool, id, None),
                        Role::Regular => {}
                    }
                    holds_report = false;
                    gen = Generation::Unknown;
                }
                tokio::time::sleep(OFF_RECHECK).await;
                continue;
            };
            // A decode's poll answers the early polls asked for so far.
            let seen = if role == Role::Decode {
                pool.capacity_signal().polling()
            } else {
                0
            };
            let healthy = pool
                .load()
                .worker(role, id)
                .is_some_and(|w| w.facts.healthy);
            let answer = if healthy {
                poll_once_body(&up, &url, &mut gen, timeout).await
            } else {
                None
            };
            store(&pool, role, id, answer.as_ref().map(|(r, _)| r));
            match role {
                Role::Decode => {
                    let figures = answer.as_ref().map(|(_, b)| super::capacity::parse(b));
                    super::capacity::store(&pool, role, id, figures.as_deref());
                }
                Role::Prefill => {
                    super::backlog::store(&pool, id, answer.as_ref().map(|(_, b)| &b[..]));
                }
                Role::Regular => {}
            }
            holds_report = true;
            // The next poll at the pace, or sooner when a request waits for what only a
            // fresh report can give it (`CapacitySignal::want_poll`), but never sooner
            // than a tenth of the pace (at least 100 ms) after this one.
            // Only a decode's report gives a request room.
            if role != Role::Decode {
                tokio::time::sleep(every).await;
                continue;
            }
            let gap = (every / 10).max(EARLY_GAP_MIN).min(every);
            let signal = pool.capacity_signal().clone();
            // Registered now: an ask during the gap is kept.
            let wanted = signal.poll_wanted();
            tokio::time::sleep(gap).await;
            if signal.poll_asks() == seen {
                tokio::select! {
                    _ = tokio::time::sleep(every - gap) => {}
                    _ = wanted => {}
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::upstream::parse_base_url;

    #[test]
    fn parses_all_three_generations() {
        use Report::{PerRank, Total};
        let table: &[(&str, Option<Report>)] = &[
            // Newest, envelope.
            (
                r#"{"loads": [{"dp_rank": 0, "timestamp": 1.5, "num_running_reqs": 3, "num_waiting_reqs": 2, "num_used_tokens": 10, "disaggregation": {"mode": "decode"}},
                              {"dp_rank": 1, "num_running_reqs": 0, "num_waiting_reqs": 4}]}"#,
                Some(PerRank(vec![(0, 5), (1, 4)])),
            ),
            // Newest, bare list, ranks out of order, waiting missing.
            (
                r#"[{"dp_rank": 1, "num_running_reqs": 7}, {"dp_rank": 0, "num_running_reqs": 1, "num_waiting_reqs": 1}]"#,
                Some(PerRank(vec![(1, 7), (0, 2)])),
            ),
            // Mid: num_reqs already includes waiting.
            (
                r#"[{"dp_rank": 0, "num_reqs": 6, "num_waiting_reqs": 2, "num_tokens": 900, "ts_tic": 3.2},
                    {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 10}]"#,
                Some(PerRank(vec![(0, 6), (1, 1)])),
            ),
            // Mid, without dp_rank: position is the rank.
            (
                r#"[{"num_reqs": 2}, {"num_reqs": 3}]"#,
                Some(PerRank(vec![(0, 2), (1, 3)])),
            ),
            // Old.
            (r#"{"load": 9}"#, Some(Total(9))),
            (r#"{"load": 2.6}"#, Some(Total(3))),
            // A single per-rank object.
            (
                r#"{"dp_rank": 1, "num_reqs": 4}"#,
                Some(PerRank(vec![(1, 4)])),
            ),
            // Empty list: an idle engine with no rank reported.
            (r#"{"loads": []}"#, Some(PerRank(vec![]))),
            // Not a load report.
            (r#"{"detail": "Not Found"}"#, None),
            (r#"{"load": -1}"#, None),
            (r#"[{"foo": 1}]"#, None),
            (r#""busy""#, None),
            ("<html>", None),
            ("", None),
        ];
        for (body, want) in table {
            assert_eq!(&parse(body.as_bytes()), want, "{body}");
        }
    }

    #[test]
    fn reports_map_onto_ranks() {
        let r = Report::PerRank(vec![(1, 7), (0, 2), (1, 1), (5, 100)]);
        assert_eq!(per_rank(&r, 2), vec![2, 8]);
        assert_eq!(per_rank(&r, 0), vec![2]);
        assert_eq!(per_rank(&Report::Total(7), 3), vec![3, 2, 2]);
        assert_eq!(per_rank(&Report::Total(7), 1), vec![7]);
        assert_eq!(
            per_rank(&Report::PerRank(vec![(0, u64::MAX), (0, 1)]), 1),
            vec![u64::MAX]
        );
    }

    /// Sends a decode `/generate` whose bootstrap server never answers, so the engine
    /// holds it as waiting on `rank`.
    async fn hold_waiting(
        up: &Upstream,
        engine: &str,
        rank: u32,
        port: u16,
    ) -> tokio::task::JoinHandle<()> {
        let uri: http::Uri = format!("{engine}/generate").parse().unwrap();
        let body = serde_json::json!({
            "text": "hello", "rid": format!("hold-{rank}"),
            "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
            "bootstrap_room": 1000 + rank, "routed_dp_rank": rank,
        })
        .to_string();
        let up = up.clone();
        tokio::spawn(async move {
            let _ = up
                .call(
                    http::Method::POST,
                    uri,
                    Some(body.into()),
                    Duration::from_secs(30),
                )
                .await;
        })
    }

    #[tokio::test]
    async fn polls_a_live_sim_engine() {
        let sim = pdgate_sim::spawn(pdgate_sim::EngineConfig::decode(2))
            .await
            .unwrap();
        let up = Upstream::new(&crate::router::upstream_settings(
            &crate::config::Config::default(),
        ));
        let url = parse_base_url(&sim.url()).unwrap();
        let pool = Pool::new();
        let id = pool.add_worker(Role::Decode, url.clone(), None);
        pool.update_worker(Role::Decode, id, |w| {
            w.facts.healthy = true;
            w.facts.dp_size = Some(2);
        });
        let t = Duration::from_secs(2);

        // Idle: the newest endpoint answers zeros.
        let mut gen = Generation::Unknown;
        let r = poll_once(&up, &url, &mut gen, t).await;
        assert_eq!(gen, Generation::Loads);
        assert_eq!(r.map(|r| per_rank(&r, 2)), Some(vec![0, 0]));

        // A request held on rank 1 shows up as waiting there, through both endpoints.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = silent.local_addr().unwrap().port();
        let held = hold_waiting(&up, &sim.url(), 1, port).await;
        let mut seen = None;
        for _ in 0..100 {
            let r = poll_once(&up, &url, &mut gen, t).await;
            store(&pool, Role::Decode, id, r.as_ref());
            let snap = pool.load();
            let w = snap.worker(Role::Decode, id).unwrap();
            if w.engine_load(1) == 1 {
                seen = Some((w.engine_load(0), w.engine_load(1)));
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(seen, Some((0, 1)), "held request never reported");
        let mut mid = Generation::GetLoad;
        let r = poll_once(&up, &url, &mut mid, t).await;
        assert_eq!(mid, Generation::GetLoad);
        assert_eq!(r.map(|r| per_rank(&r, 2)), Some(vec![0, 1]));

        // A failed poll (engine gone) zeroes the slots.
        held.abort();
        drop(sim);
        let r = poll_once(&up, &url, &mut gen, Duration::from_millis(300)).await;
        assert!(r.is_none());
        store(&pool, Role::Decode, id, r.as_ref());
        let snap = pool.load();
        let w = snap.worker(Role::Decode, id).unwrap();
        assert_eq!((w.engine_load(0), w.engine_load(1)), (0, 0));
        drop(silent);
    }
}
