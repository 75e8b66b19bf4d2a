//! One tracker per prefill: the decode engine's bootstrap poll, run by the router ahead of
//! the decode engine (spec §3.2 steps 3–5, §3.4, §7.2).
//!
//! Two tasks per prefill share the pool as their only output (the request-path check of one
//! rank is `super::preflight`):
//! - the *refresher* learns the layout from the sentinel and every rank's route, every
//!   `refresh_interval` (and at once when woken), up to `RANK_POLLS` rank routes at once;
//! - the *heartbeat* polls the bootstrap server's `/health` every `heartbeat_interval`;
//!   `heartbeat_max_failures` misses in a row mark the prefill lost: every rank goes
//!   `Failed{Unreachable}`, the layout is dropped (as decode drops its cache) and the
//!   prefill's lost epoch is bumped, which fails its in-flight requests at once.
//!
//! Invariant: a rank is `Ready` only after its own `GET /route` answered 200 within the
//! freshness bound of the last check; every transition is logged and counted.

use std::sync::Arc;
use std::time::Instant;

use futures_util::StreamExt;
use tokio::sync::Notify;

use super::client::{self, BootstrapError, RankRoute, Sentinel};
use crate::config::{BootstrapConfig, LiveConfig};
use crate::pool::{BootstrapInfo, Pool, RankFailure, RankReadiness, WorkerState};
use crate::types::{Role, WorkerId};
use crate::upstream::{BaseUrl, Upstream};

/// Rank routes the refresher asks for at once.
const RANK_POLLS: usize = 16;

/// SGLang's default `--disaggregation-bootstrap-port` (defined in the protocol crate).
pub use sglang_pd::DEFAULT_BOOTSTRAP_PORT;

/// Moves one rank to `new`, logging and counting a real transition.
pub fn set_rank(w: &mut WorkerState, rank: usize, new: RankReadiness, now: Instant) {
    if w.ranks.len() <= rank {
        w.ranks.resize(rank + 1, RankReadiness::Unknown);
        w.ranks_checked_at.resize(rank + 1, now);
    }
    w.ranks_checked_at[rank] = now;
    let old = &w.ranks[rank];
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
        tracing::info!(
            prefill = %w.url, rank, from = old.label(), to = new.label(), reason,
            "bootstrap rank state"
        );
        metrics::counter!(crate::telemetry::BOOTSTRAP_RANK_TRANSITIONS, "to" => new.label())
            .increment(1);
        if *old == RankReadiness::Ready {
            // Requests in flight on this rank whose prefill has not answered would have
            // their decode fail (or, on engines without SGLang PR #24772, hang): end them.
            w.lost_tx.send_modify(|e| {
                if e.ranks.len() <= rank {
                    e.ranks.resize(rank + 1, 0);
                }
                e.ranks[rank] += 1;
            });
        }
        w.ranks[rank] = new;
    }
}

fn fail_all(w: &mut WorkerState, reason: RankFailure, now: Instant) {
    let n = w.ranks.len().max(1);
    for r in 0..n {
        set_rank(w, r, RankReadiness::Failed { reason, since: now }, now);
    }
}

/// Applies a rank lookup's outcome (used by the refresher and by request-path preflight).
pub fn apply_rank(
    w: &mut WorkerState,
    rank: usize,
    res: &Result<RankRoute, BootstrapError>,
    now: Instant,
) {
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
    set_rank(w, rank, st, now);
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
        let port = match port {
            Some(p) => p,
            None => discover_port(&up, &live, &engine).await,
        };
        let host = host.unwrap_or_else(|| engine.host().to_string());
        let info = BootstrapInfo {
            url: engine.with_port(port),
            host_json: serde_json::Value::String(host).to_string(),
            port,
        };
        let url = info.url.clone();
        pool.update_worker(Role::Prefill, id, |w| w.bootstrap = Some(info));
        let wake = Arc::new(Notify::new());
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

/// The engine's `disaggregation_bootstrap_port`, else 8998 (retrying while unreachable).
async fn discover_port(up: &Upstream, live: &LiveConfig, engine: &BaseUrl) -> u16 {
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
                tracing::warn!(prefill = %engine, status, "no server info; using bootstrap port 8998");
                return DEFAULT_BOOTSTRAP_PORT;
            }
            Err(e) => {
                attempts += 1;
                if attempts == 1 || attempts.is_multiple_of(30) {
                    tracing::warn!(prefill = %engine, error = %e, "prefill unreachable; waiting to learn its bootstrap port");
                }
                tokio::time::sleep(cfg.refresh_interval()).await;
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
        refresh_once(&pool, &up, &cfg, id, &url).await;
        tokio::select! {
            _ = tokio::time::sleep(cfg.refresh_interval()) => {}
            _ = wake.notified() => {}
        }
    }
}

/// Reads the sentinel, then every rank's route, and publishes the result.
pub async fn refresh_once(
    pool: &Pool,
    up: &Upstream,
    cfg: &BootstrapConfig,
    id: WorkerId,
    url: &BaseUrl,
) {
    let gen = pool
        .with_worker(Role::Prefill, id, |w| {
            w.layout.as_ref().map(|l| l.generation)
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
            pool.update_worker(Role::Prefill, id, |w| {
                first = w.layout.is_none();
                if w.layout.as_ref() != Some(&layout) {
                    tracing::info!(prefill = %w.url, dp = layout.dp_size, follow_bootstrap_room = layout.follow_bootstrap_room,
                        page_size = ?layout.page_size, kv_cache_dtype = ?layout.kv_cache_dtype, "prefill layout");
                    if !layout.follow_bootstrap_room {
                        tracing::warn!(prefill = %w.url, "prefill does not follow bootstrap_room; the contract then holds only through /register_dp_rank (R8)");
                    }
                }
                w.ranks.truncate(layout.dp_size as usize);
                w.ranks_checked_at.truncate(layout.dp_size as usize);
                w.layout = Some(layout.clone());
                for (r, res) in results.iter().enumerate() {
                    apply_rank(w, r, res, now);
                }
            });
            if first {
                pool.warn_mismatches();
            }
        }
        Ok(Sentinel::NotReady(text)) => {
            pool.update_worker(Role::Prefill, id, |w| {
                let n = w
                    .layout
                    .as_ref()
                    .map_or(w.ranks.len().max(1), |l| l.dp_size as usize);
                for r in 0..n {
                    set_rank(w, r, RankReadiness::Bootstrapping, now);
                }
                tracing::debug!(prefill = %w.url, text, "bootstrap server not ready");
            });
        }
        Err(e) => {
            let reason = match e {
                BootstrapError::Unreachable(_) => RankFailure::Unreachable,
                BootstrapError::BadAnswer { .. } | BootstrapError::DpSizeTooLarge { .. } => {
                    RankFailure::BadAnswer
                }
            };
            pool.update_worker(Role::Prefill, id, |w| {
                if matches!(e, BootstrapError::DpSizeTooLarge { .. }) {
                    if w.ranks.iter().all(|r| r.label() != "failed") {
                        tracing::error!(prefill = %w.url, error = %e, "prefill refused");
                    }
                } else {
                    tracing::debug!(prefill = %w.url, error = %e, "sentinel failed");
                }
                fail_all(w, reason, now);
            });
        }
    }
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
    let mut every = live.load().bootstrap.heartbeat_interval();
    let mut tick = tokio::time::interval(every);
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
        match client::health(&up, &url, timeout).await {
            Ok(()) => {
                misses = 0;
                if lost {
                    lost = false;
                    tracing::info!(bootstrap = %url, "bootstrap heartbeat back");
                    wake.notify_one();
                }
            }
            Err(e) => {
                misses += 1;
                if misses >= cfg.heartbeat_max_failures && !lost {
                    lost = true;
                    let now = Instant::now();
                    tracing::warn!(bootstrap = %url, misses, error = %e, "bootstrap heartbeat lost; failing in-flight requests");
                    metrics::counter!(crate::telemetry::BOOTSTRAP_HEARTBEAT_LOST).increment(1);
                    pool.update_worker(Role::Prefill, id, |w| {
                        fail_all(w, RankFailure::Unreachable, now);
                        w.layout = None;
                        w.lost_tx.send_modify(|e| e.heartbeat += 1);
                    });
                }
            }
        }
    }
}
