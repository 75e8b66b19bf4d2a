//! One tracker per prefill: the decode engine's bootstrap poll, run by the router ahead of
//! the decode engine (spec §3.2 steps 3–5, §3.4, §7.2), at a cost per engine that does
//! not grow with the DP size.
//!
//! Two tasks per prefill share the pool as their only output (the request-path check of one
//! rank is `super::preflight`):
//! - the *heartbeat* is the one liveness check per engine: the sentinel `GET /route` every
//!   `heartbeat_interval` (one request whatever the DP size; it answers the layout, and 503
//!   while not every rank is registered, as after a restart). A ready answer with the same
//!   layout confirms every rank's route (atomics, no snapshot rebuild); 503 makes every
//!   rank `Bootstrapping`; a refused or cut connection fails every rank at once (as
//!   decode's first failed lookup would), and `heartbeat_max_failures` misses in a row mark
//!   the prefill lost: the layout is dropped (as decode drops its cache) and the prefill's
//!   lost epoch is bumped, which fails its in-flight requests at once.
//! - the *refresher* re-reads the sentinel and every rank's route: at start, at once on a
//!   signal (the heartbeat saw the layout change, the server come back ready, or a ready
//!   server while some rank is still marked not ready by another path; the health
//!   checker saw the engine restart, a leg or a preflight failed for a bootstrap reason:
//!   the worker's `refresh` notify), and otherwise at the slow jittered pace of
//!   `refresh_interval`. Signals are coalesced (one `Notify` permit), and re-reads are
//!   spaced so that rank-route reads average at most `max_route_reads_per_sec`.
//!
//! Invariants:
//! - A rank is `Ready` only after its own `GET /route` answered 200, and stays fresh only
//!   while that route or a same-layout ready sentinel was confirmed within the freshness
//!   bound; every transition is logged and counted.
//! - The snapshot is rebuilt only on a transition (a rank's readiness, the layout, a
//!   loss); confirmations are stored into the worker's `RankFreshness` atomics.
//! - Idle, one router sends one bootstrap server `1/heartbeat_interval` sentinels plus
//!   `(dp + 1)/refresh_interval` route reads a second, and never more than
//!   `1/heartbeat_interval + max_route_reads_per_sec` on average, whatever the DP size.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use tokio::sync::Notify;

use super::client::{self, BootstrapError, Generation, RankRoute, Sentinel};
use crate::config::{BootstrapConfig, LiveConfig};
use crate::pool::{BootstrapInfo, Pool, RankFailure, RankReadiness, Worker};
use crate::types::{Role, WorkerId, WorkerIdent};
use crate::upstream::{BaseUrl, CallError, Upstream};

/// Rank routes the refresher asks for at once.
const RANK_POLLS: usize = 16;

/// SGLang's default `--disaggregation-bootstrap-port` (defined in the protocol crate).
pub use sglang_pd::DEFAULT_BOOTSTRAP_PORT;

/// Moves one rank to `new`, logging and counting a real transition; true when it was one.
pub fn set_rank(w: &mut Worker, rank: usize, new: RankReadiness, _now: Instant) -> bool {
    if w.facts.ranks.len() <= rank {
        w.facts.ranks.resize(rank + 1, RankReadiness::Unknown);
    }
    let old = &w.facts.ranks[rank];
    let changed = match (old, &new) {
        (RankReadiness::Failed { reason: a, .. }, RankReadiness::Failed { reason: b, .. }) => {
            a != b
        }
        (a, b) => a != b,
    };
    if changed {
        let reason = match &new {
            RankReadiness::Failed { reason, .. } => reason.label(),
            _ => "",
        };
        // Start-up (from unknown) at INFO; every later transition at WARN.
        if *old == RankReadiness::Unknown {
            tracing::info!(
                worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, rank, from = old.label(), to = new.label(), reason,
                "bootstrap rank state"
            );
        } else {
            tracing::warn!(
                worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, rank, from = old.label(), to = new.label(), reason,
                "bootstrap rank state"
            );
        }
        metrics::counter!(crate::telemetry::BOOTSTRAP_RANK_TRANSITIONS, "to" => new.label())
            .increment(1);
        if *old == RankReadiness::Ready {
            // Requests in flight on this rank whose prefill has not answered would have
            // their decode fail (or, on engines without SGLang PR #24772, hang): end them.
            w.shared().lost_tx.send_modify(|e| {
                if e.ranks.len() <= rank {
                    e.ranks.resize(rank + 1, 0);
                }
                e.ranks[rank] += 1;
            });
        }
        w.facts.ranks[rank] = new;
    }
    changed
}

fn fail_all(w: &mut Worker, reason: RankFailure, now: Instant) -> bool {
    let n = w.facts.ranks.len().max(1);
    let mut changed = false;
    for r in 0..n {
        changed |= set_rank(w, r, RankReadiness::Failed { reason, since: now }, now);
    }
    changed
}

/// Every rank `Bootstrapping` (the sentinel answered 503).
fn all_bootstrapping(w: &mut Worker, now: Instant) -> bool {
    let n = w
        .facts
        .layout
        .as_ref()
        .map_or(w.facts.ranks.len().max(1), |l| l.dp_size as usize);
    let mut changed = false;
    for r in 0..n {
        changed |= set_rank(w, r, RankReadiness::Bootstrapping, now);
    }
    changed
}

/// Applies a rank lookup's outcome (used by the refresher and by request-path preflight);
/// true when the rank's readiness changed.
pub fn apply_rank(
    w: &mut Worker,
    rank: usize,
    res: &Result<RankRoute, BootstrapError>,
    now: Instant,
) -> bool {
    let st = match res {
        Ok(RankRoute::Ready { .. }) => RankReadiness::Ready,
        Ok(RankRoute::NotReady) => RankReadiness::Bootstrapping,
        Ok(RankRoute::Missing(_)) => RankReadiness::Failed {
            reason: RankFailure::RankMissing,
            since: now,
        },
        Err(BootstrapError::Unreachable(_)) => RankReadiness::Failed {
            reason: RankFailure::Unreachable,
            since: now,
        },
        Err(BootstrapError::BadAnswer { .. } | BootstrapError::DpSizeTooLarge { .. }) => {
            RankReadiness::Failed {
                reason: RankFailure::BadAnswer,
                since: now,
            }
        }
    };
    set_rank(w, rank, st, now)
}

/// The failure a bootstrap call that did not answer stands for.
fn failure_of(e: &BootstrapError) -> RankFailure {
    match e {
        BootstrapError::Unreachable(_) => RankFailure::Unreachable,
        BootstrapError::BadAnswer { .. } | BootstrapError::DpSizeTooLarge { .. } => {
            RankFailure::BadAnswer
        }
    }
}

/// Starts the tracker of prefill `id`.
///
/// Its tasks end when the worker leaves the pool; each step reads the bootstrap settings
/// of the live config.
pub fn spawn(
    pool: Arc<Pool>,
    up: Upstream,
    live: LiveConfig,
    id: WorkerId,
    engine: BaseUrl,
    port: Option<u16>,
    host: Option<String>,
) {
    let p2 = pool.clone();
    p2.spawn_task(Role::Prefill, id, async move {
        let (given, host_given) = (port.is_some(), host.is_some());
        let port = match port {
            Some(p) => p,
            None => discover_port(&pool, &up, &live, id, &engine).await,
        };
        let host = host.unwrap_or_else(|| engine.host().to_string());
        let info = BootstrapInfo {
            url: engine.with_port(port),
            host_json: serde_json::Value::String(host).to_string(),
            port,
        };
        let url = info.url.clone();
        let mut wake = Arc::new(Notify::new());
        pool.update_worker(Role::Prefill, id, |w| {
            w.facts.bootstrap = Some(info);
            wake = w.shared().refresh.clone();
        });
        // Not routable (no request is sent to it) before its bootstrap server is proved to
        // be its own; the proof runs beside the tracker, which follows the ranks meanwhile.
        pool.update_worker(Role::Prefill, id, |w| {
            w.facts.bootstrap_refused = Some(super::ownership::UNPROVED.to_string());
        });
        {
            let (pool2, up2, live2) = (pool.clone(), up.clone(), live.clone());
            let (engine2, url2) = (engine.clone(), url.clone());
            pool.spawn_task(Role::Prefill, id, async move {
                let proof = Proof {
                    id,
                    engine: &engine2,
                    bootstrap: &url2,
                    port,
                    given,
                    host_given,
                };
                let verdict = prove(&pool2, &up2, &live2, proof).await;
                if let Some(m) = &verdict {
                    tracing::error!(
                        worker_id = %WorkerIdent::new(Role::Prefill, id),
                        worker_url = %engine2,
                        bootstrap = %url2,
                        reason = m.label(),
                        error = %m.message(),
                        "prefill refused: its bootstrap server is not its own"
                    );
                    metrics::counter!(crate::telemetry::BOOTSTRAP_REFUSED, "reason" => m.label())
                        .increment(1);
                }
                pool2.update_worker(Role::Prefill, id, |w| {
                    w.facts.bootstrap_refused = verdict.map(|m| m.message());
                });
            });
        }
        pool.spawn_task(
            Role::Prefill,
            id,
            heartbeat(
                pool.clone(),
                up.clone(),
                live.clone(),
                id,
                url.clone(),
                wake.clone(),
            ),
        );
        refresher(pool, up, live, id, url, wake).await;
    });
}

/// What [`prove`] checks.
struct Proof<'a> {
    id: WorkerId,
    engine: &'a BaseUrl,
    bootstrap: &'a BaseUrl,
    port: u16,
    given: bool,
    host_given: bool,
}

/// Proves that the bootstrap server is the prefill's own ([`super::ownership`]); waits
/// (one heartbeat interval at a time) while the engine or the bootstrap server cannot tell
/// yet. `Some`: it is not.
async fn prove(
    pool: &Pool,
    up: &Upstream,
    live: &LiveConfig,
    p: Proof<'_>,
) -> Option<super::ownership::Mismatch> {
    use super::ownership::{judge, owner, Mismatch, Owner};
    loop {
        let cfg = live.load().bootstrap.clone();
        let timeout = cfg.http_timeout();
        let reported = if p.given && !p.host_given {
            match client::server_info(up, p.engine, timeout).await {
                Ok(info) => info.disaggregation_bootstrap_port,
                Err(BootstrapError::BadAnswer { .. }) => None,
                Err(_) => {
                    tokio::time::sleep(cfg.heartbeat_interval()).await;
                    continue;
                }
            }
        } else {
            None
        };
        let owner_port = if p.host_given {
            None
        } else {
            match owner(up, p.bootstrap, timeout).await {
                Owner::Known(o) => o,
                Owner::NotYet => {
                    tokio::time::sleep(cfg.heartbeat_interval()).await;
                    continue;
                }
            }
        };
        if let Some(m) = judge(
            p.engine.port(),
            p.port,
            p.given,
            p.host_given,
            reported,
            owner_port,
        ) {
            return Some(m);
        }
        // Proof 3, where the server does not name its owner (else proof 2 settled it).
        if owner_port.is_some() && !p.host_given {
            return None;
        }
        let snap = pool.load();
        let first = snap.prefills.iter().find(|w| {
            w.shared.id < p.id
                && w.facts
                    .refusal()
                    .is_none_or(|r| r == super::ownership::UNPROVED)
                && w.facts
                    .bootstrap
                    .as_ref()
                    .is_some_and(|b| b.url == *p.bootstrap)
        });
        return first.map(|w| Mismatch::Shared {
            bootstrap: p.bootstrap.to_string(),
            other: format!("prefill {}", w.shared.url),
        });
    }
}

/// The engine's `disaggregation_bootstrap_port`, else 8998 (retrying while unreachable).
///
/// An engine down at start is asked again when its health check first sees it up (it
/// wakes the worker's `refresh`), else at the slow re-read interval: the port is known,
/// and the prefill routable, within about one health interval of its engine coming up.
async fn discover_port(
    pool: &Pool,
    up: &Upstream,
    live: &LiveConfig,
    id: WorkerId,
    engine: &BaseUrl,
) -> u16 {
    let Some(wake) = pool.with_worker(Role::Prefill, id, |w| w.shared().refresh.clone()) else {
        return DEFAULT_BOOTSTRAP_PORT; // the worker already left the pool
    };
    let mut attempts = 0u32;
    loop {
        let cfg = live.load().bootstrap.clone();
        match client::server_info(up, engine, cfg.http_timeout()).await {
            Ok(info) => {
                return info
                    .disaggregation_bootstrap_port
                    .unwrap_or(DEFAULT_BOOTSTRAP_PORT)
            }
            Err(BootstrapError::BadAnswer { status, .. }) => {
                tracing::warn!(worker_id = %WorkerIdent::new(Role::Prefill, id), worker_url = %engine, status, "no server info; using bootstrap port 8998");
                return DEFAULT_BOOTSTRAP_PORT;
            }
            Err(e) => {
                attempts += 1;
                // Its health check names an engine that is down (at WARN, with the
                // reason); this says what waits on it.
                if attempts == 1 {
                    tracing::info!(worker_id = %WorkerIdent::new(Role::Prefill, id), worker_url = %engine, error = %e, "prefill unreachable; waiting to learn its bootstrap port");
                } else if attempts.is_multiple_of(30) {
                    tracing::warn!(worker_id = %WorkerIdent::new(Role::Prefill, id), worker_url = %engine, error = %e, attempts, "prefill still unreachable; its bootstrap port is unknown");
                }
                tokio::select! {
                    _ = tokio::time::sleep(cfg.refresh_interval()) => {}
                    _ = wake.notified() => {}
                }
            }
        }
    }
}

async fn refresher(
    pool: Arc<Pool>,
    up: Upstream,
    live: LiveConfig,
    id: WorkerId,
    url: BaseUrl,
    wake: Arc<Notify>,
) {
    loop {
        let cfg = live.load().bootstrap.clone();
        let reads = refresh_once(&pool, &up, &cfg, id, &url).await;
        // The budget: the next re-read starts no sooner than these reads allow.
        let spacing = budget_spacing(reads, cfg.max_route_reads_per_sec);
        let pause = jittered(cfg.refresh_interval(), cfg.refresh_jitter, rand::random());
        let t0 = tokio::time::Instant::now();
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            _ = wake.notified() => {}
        }
        tokio::time::sleep_until(t0 + spacing).await;
    }
}

/// The least time between the start of two re-reads after one that made `reads` requests,
/// so that they average at most `per_sec`.
pub fn budget_spacing(reads: u32, per_sec: f64) -> Duration {
    if !(per_sec.is_finite() && per_sec > 0.0) {
        return Duration::ZERO;
    }
    Duration::from_secs_f64(f64::from(reads) / per_sec)
}

/// `base` times `1 + jitter × (2u − 1)` for `u` in [0, 1).
pub fn jittered(base: Duration, jitter: f64, u: f64) -> Duration {
    let j = jitter.clamp(0.0, 0.5);
    let f = 1.0 + j * (2.0 * u.clamp(0.0, 1.0) - 1.0);
    base.mul_f64(f.max(0.0))
}

/// Reads the sentinel, then every rank's route, and publishes the result (a snapshot
/// only on a transition). Returns the number of requests it made.
pub async fn refresh_once(
    pool: &Pool,
    up: &Upstream,
    cfg: &BootstrapConfig,
    id: WorkerId,
    url: &BaseUrl,
) -> u32 {
    let gen = pool
        .with_worker(Role::Prefill, id, |w| {
            w.facts.layout.as_ref().map(|l| l.generation)
        })
        .flatten();
    let sentinel = client::sentinel(up, url, gen, cfg.http_timeout()).await;
    let now = Instant::now();
    match sentinel {
        Ok(Sentinel::Ready(layout)) => {
            // Every rank's route, RANK_POLLS at a time (in rank order), so that a slow or
            // dead bootstrap server costs one timeout per batch, not one per rank.
            let results: Vec<_> = futures_util::stream::iter(0..layout.dp_size)
                .map(|r| client::rank_route(up, url, layout.generation, r, cfg.http_timeout()))
                .buffered(RANK_POLLS)
                .collect()
                .await;
            let now = Instant::now();
            let mut first = false;
            pool.update_worker_if(Role::Prefill, id, |w| {
                first = w.facts.layout.is_none();
                let mut changed = w.facts.layout.as_ref() != Some(&layout);
                if changed {
                    tracing::info!(worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, dp = layout.dp_size, follow_bootstrap_room = layout.follow_bootstrap_room,
                        page_size = ?layout.page_size, kv_cache_dtype = ?layout.kv_cache_dtype, "prefill layout");
                    if !layout.follow_bootstrap_room {
                        tracing::warn!(worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, "prefill does not follow bootstrap_room; the contract then holds only through /register_dp_rank");
                    }
                }
                changed |= w.facts.ranks.len() > layout.dp_size as usize;
                w.facts.ranks.truncate(layout.dp_size as usize);
                w.facts.layout = Some(layout.clone());
                for (r, res) in results.iter().enumerate() {
                    changed |= apply_rank(w, r, res, now);
                }
                changed
            });
            // Stamped after publishing: a new DP size comes with new freshness slots.
            if let Some(w) = pool.load().worker(Role::Prefill, id) {
                for (r, res) in results.iter().enumerate() {
                    if res.is_ok() {
                        w.per_rank.fresh.checked(r, now);
                    }
                }
            }
            if first {
                pool.warn_mismatches();
            }
            1 + layout.dp_size
        }
        Ok(Sentinel::NotReady(text)) => {
            pool.update_worker_if(Role::Prefill, id, |w| {
                tracing::debug!(worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, text, "bootstrap server not ready");
                all_bootstrapping(w, now)
            });
            1
        }
        Err(e) => {
            pool.update_worker_if(Role::Prefill, id, |w| {
                if matches!(e, BootstrapError::DpSizeTooLarge { .. }) {
                    if w.facts.ranks.iter().all(|r| r.label() != "failed") {
                        tracing::error!(worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, error = %e, "prefill refused");
                    }
                } else {
                    tracing::debug!(worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, error = %e, "sentinel failed");
                }
                fail_all(w, failure_of(&e), now)
            });
            1
        }
    }
}

/// What the last heartbeat saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Beat {
    Ready,
    NotReady,
    Missed,
}

/// Whether a missed heartbeat fails every rank at once: the bootstrap server refused or
/// cut the connection, or answered something that is not the protocol. A timeout alone
/// (a slow answer) fails them only with the loss, after `heartbeat_max_failures`.
fn definite_miss(e: &BootstrapError) -> bool {
    !matches!(e, BootstrapError::Unreachable(CallError::Timeout(_)))
}

async fn heartbeat(
    pool: Arc<Pool>,
    up: Upstream,
    live: LiveConfig,
    id: WorkerId,
    url: BaseUrl,
    wake: Arc<Notify>,
) {
    let mut misses = 0u32;
    let mut lost = false;
    let mut last: Option<Beat> = None;
    let mut gen: Option<Generation> = None;
    let mut every = live.load().bootstrap.heartbeat_interval();
    // The first beat one interval after the refresher's first read.
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let cfg = live.load().bootstrap.clone();
        if cfg.heartbeat_interval() != every {
            // A reload changed the interval: the next beat follows it.
            every = cfg.heartbeat_interval();
            tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        // A heartbeat must answer within one interval to count.
        let timeout = cfg.heartbeat_interval().min(cfg.http_timeout());
        if gen.is_none() {
            gen = pool
                .load()
                .worker(Role::Prefill, id)
                .and_then(|w| w.facts.layout.as_ref().map(|l| l.generation));
        }
        let res = client::sentinel(&up, &url, gen, timeout).await;
        let now = Instant::now();
        if res.is_ok() {
            misses = 0;
            if lost {
                lost = false;
                tracing::info!(worker_id = %WorkerIdent::new(Role::Prefill, id), bootstrap = %url, "bootstrap heartbeat back");
            }
        }
        match res {
            Ok(Sentinel::Ready(layout)) => {
                gen = Some(layout.generation);
                let stored = pool.load().worker(Role::Prefill, id).map(|w| {
                    let same = w.facts.layout.as_ref() == Some(&layout);
                    if same && matches!(last, None | Some(Beat::Ready)) {
                        // The routes read before still hold: no request, no rebuild.
                        w.per_rank.fresh.confirm_all(now);
                    }
                    // Ranks that another path failed (a preflight or a leg that could not
                    // reach the server, whose signalled re-read came while it was still
                    // down) are re-read now that the server answers ready.
                    let behind = w
                        .facts
                        .ranks
                        .iter()
                        .any(|r| !matches!(r, RankReadiness::Ready));
                    (same, behind)
                });
                let (same, behind) = stored.unwrap_or((false, false));
                if !same || behind || matches!(last, Some(Beat::NotReady | Beat::Missed)) {
                    // A layout change, the server (back) ready, or ranks left behind:
                    // re-read every route (coalesced, within the read budget).
                    wake.notify_one();
                }
                last = Some(Beat::Ready);
            }
            Ok(Sentinel::NotReady(_)) => {
                if last != Some(Beat::NotReady) {
                    pool.update_worker_if(Role::Prefill, id, |w| all_bootstrapping(w, now));
                }
                last = Some(Beat::NotReady);
            }
            Err(e) => {
                misses += 1;
                last = Some(Beat::Missed);
                let lose = misses >= cfg.heartbeat_max_failures && !lost;
                let reason = failure_of(&e);
                if lose || definite_miss(&e) {
                    pool.update_worker_if(Role::Prefill, id, |w| {
                        if matches!(e, BootstrapError::DpSizeTooLarge { .. })
                            && w.facts.ranks.iter().all(|r| r.label() != "failed")
                        {
                            tracing::error!(worker_id = %WorkerIdent::new(Role::Prefill, w.shared().id), worker_url = %w.shared().url, error = %e, "prefill refused");
                        }
                        let mut changed = fail_all(w, reason, now);
                        if lose {
                            tracing::warn!(worker_id = %WorkerIdent::new(Role::Prefill, id), bootstrap = %url, misses, error = %e, "bootstrap heartbeat lost; failing in-flight requests");
                            metrics::counter!(crate::telemetry::BOOTSTRAP_HEARTBEAT_LOST)
                                .increment(1);
                            w.facts.layout = None;
                            w.shared().lost_tx.send_modify(|e| e.heartbeat += 1);
                            changed = true;
                        }
                        changed
                    });
                }
                if lose {
                    lost = true;
                    gen = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_within_its_band() {
        let base = Duration::from_secs(30);
        let table = [
            (0.2, 0.0, 24.0),
            (0.2, 0.5, 30.0),
            (0.2, 0.999_999, 36.0),
            (0.0, 0.9, 30.0),
            (0.9, 0.0, 15.0), // clamped to 0.5
        ];
        for (j, u, want) in table {
            let got = jittered(base, j, u).as_secs_f64();
            assert!((got - want).abs() < 1e-3, "{j} {u}: {got}");
        }
    }

    #[test]
    fn spacing_holds_the_budget_whatever_the_dp_size() {
        for dp in [1u32, 8, 64, 1024] {
            let reads = dp + 1;
            let gap = budget_spacing(reads, 2.0);
            let rate = f64::from(reads) / gap.as_secs_f64();
            assert!((rate - 2.0).abs() < 1e-9, "dp {dp}: {rate}/s");
        }
        assert_eq!(budget_spacing(9, 0.0), Duration::ZERO);
    }
}
