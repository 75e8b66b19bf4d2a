//! Active health checks of engines (`GET /health`) with failure/success thresholds, and
//! the reading of each decode's `/server_info` (its DP size, page size, KV dtype).
//!
//! Invariant: a worker becomes unhealthy after `failure_threshold` failed checks in a row
//! and healthy again after `success_threshold` good ones; it starts unhealthy until its
//! first good check. Health probes on PD engines use a fake bootstrap (spec R10), so for
//! prefills this is combined with the bootstrap tracker's readiness in the pool.

pub mod load;

use std::sync::Arc;

use crate::bootstrap::client;
use crate::config::{BootstrapConfig, HealthConfig};
use crate::pool::Pool;
use crate::types::{Role, WorkerId};
use crate::upstream::{BaseUrl, Upstream};

/// Starts the health checker of one worker (and, for a decode, its server-info reader).
pub fn spawn(
    pool: Arc<Pool>,
    up: Upstream,
    cfg: HealthConfig,
    bcfg: BootstrapConfig,
    role: Role,
    id: WorkerId,
    url: BaseUrl,
) {
    tokio::spawn(async move {
        let (mut ok_run, mut fail_run) = (0u32, 0u32);
        let mut have_info = false;
        let conns = pool.with_worker(role, id, |w| w.conns.clone());
        let mut tick = tokio::time::interval(cfg.interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let good = matches!(up.get(&url, "/health", cfg.timeout()).await, Ok((s, _)) if s.is_success());
            if good && !have_info {
                if let Ok(info) = client::server_info(&up, &url, bcfg.http_timeout()).await {
                    have_info = true;
                    pool.update_worker(role, id, |w| {
                        if role == Role::Decode {
                            w.dp_size = info.dp_size.filter(|d| *d >= 1);
                        }
                        w.info = Some(info);
                    });
                    warn_mismatches(&pool);
                }
            }
            // Idle leg connections past their timeout are closed here, off the request path.
            if let Some(conns) = &conns {
                conns.sweep(up.legs.idle_timeout);
            }
            if good {
                ok_run += 1;
                fail_run = 0;
            } else {
                fail_run += 1;
                ok_run = 0;
            }
            let flip = pool
                .with_worker(role, id, |w| {
                    (!w.healthy && ok_run >= cfg.success_threshold)
                        || ((w.healthy || !w.health_checked) && fail_run >= cfg.failure_threshold)
                })
                .unwrap_or(false);
            if flip {
                pool.update_worker(role, id, |w| {
                    w.healthy = good;
                    w.health_checked = true;
                    tracing::info!(role = %role, worker = %w.url, healthy = good, "worker health");
                    metrics::gauge!("pdgate_worker_healthy", "role" => role.as_str(), "worker" => w.url.to_string())
                        .set(if good { 1.0 } else { 0.0 });
                });
            }
        }
    });
}

/// A prefill and a decode that disagree on a KV layout fact (page size or KV dtype): a
/// decode would crash its scheduler on such a pair (spec §7.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayoutMismatch {
    pub prefill: String,
    pub decode: String,
    /// `page_size` or `kv_cache_dtype`.
    pub what: &'static str,
    pub prefill_value: String,
    pub decode_value: String,
}

/// Every (prefill, decode) pair whose known layouts disagree. A fact one side has not
/// reported yet is not compared.
pub fn layout_mismatches(pool: &Pool) -> Vec<LayoutMismatch> {
    let snap = pool.load_full();
    let mut out = Vec::new();
    for p in &snap.prefills {
        let Some(layout) = &p.layout else { continue };
        for d in &snap.decodes {
            let Some(info) = pool
                .with_worker(Role::Decode, d.id, |w| w.info.clone())
                .flatten()
            else {
                continue;
            };
            let mut differ = |what, a: Option<String>, b: Option<String>| {
                if let (Some(a), Some(b)) = (a, b) {
                    if a != b {
                        out.push(LayoutMismatch {
                            prefill: p.url.to_string(),
                            decode: d.url.to_string(),
                            what,
                            prefill_value: a,
                            decode_value: b,
                        });
                    }
                }
            };
            let page = |v: Option<u64>| v.map(|v| v.to_string());
            differ("page_size", page(layout.page_size), page(info.page_size));
            differ(
                "kv_cache_dtype",
                layout.kv_cache_dtype.clone(),
                info.kv_cache_dtype.clone(),
            );
        }
    }
    out
}

/// Logs every layout mismatch and sets the `pdgate_layout_mismatches` gauge (called as
/// layouts and engine facts are learned).
pub fn warn_mismatches(pool: &Pool) {
    let found = layout_mismatches(pool);
    metrics::gauge!("pdgate_layout_mismatches").set(found.len() as f64);
    for m in &found {
        tracing::warn!(prefill = %m.prefill, decode = %m.decode, prefill_value = %m.prefill_value, decode_value = %m.decode_value, "{} differs between prefill and decode", m.what);
    }
}
