//! Active health checks of engines (`GET /health`) with failure/success thresholds, and
//! the reading of each engine's `/server_info` (its DP size, page size, KV dtype).
//!
//! Invariants:
//! - A worker that has never been healthy (at start, or when added) becomes routable at its
//!   first good check: the success threshold applies only to re-admission after the worker
//!   was taken out. Operators copy SGLang's router flags (60 s interval, success threshold
//!   2); with them a fleet would otherwise wait a minute after start for its first request.
//! - A healthy worker becomes unhealthy after `failure_threshold` failed checks in a row,
//!   and an unhealthy one healthy again after `success_threshold` good ones.
//! - A worker that is not healthy is probed every `min(interval, unhealthy_interval)`, so a
//!   restarted engine is back within a few seconds whatever the healthy interval is
//!   (Envoy's `unhealthy_interval`).
//! - The server info is read again whenever the engine comes back after being down (a
//!   restart may change its DP size or role); an engine whose `disaggregation_mode` is not
//!   its role, or whose DP size is past the bound, is refused (out of rotation, named in
//!   `/readiness`) until a later read admits it: a refused engine's info is read at
//!   every good check, so a restart quicker than a failed check is caught too.
//! - Health probes on PD engines use a fake bootstrap (spec R10), so for prefills this is
//!   combined with the bootstrap tracker's readiness in the pool.

pub mod backlog;
pub mod capacity;
pub mod load;
mod report;

use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::client;
use crate::config::{HealthConfig, LiveConfig};
use crate::pool::Pool;
use crate::types::{Role, WorkerId, WorkerIdent};
use crate::upstream::{BaseUrl, Upstream};

/// The health verdict of one worker, fed one check at a time (pure; the task below
/// drives it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HealthRun {
    ok_run: u32,
    fail_run: u32,
    /// The worker passed a check at least once (its first admission is done).
    ever_healthy: bool,
}

/// What one check decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Nothing changes.
    Keep,
    /// The worker becomes healthy.
    Up,
    /// The worker becomes unhealthy (or, never healthy yet, is known to be down).
    Down,
}

impl HealthRun {
    /// Feeds one check's result; `healthy` is the worker's current state.
    pub fn observe(&mut self, good: bool, healthy: bool, cfg: &HealthConfig) -> Verdict {
        if good {
            self.ok_run = self.ok_run.saturating_add(1);
            self.fail_run = 0;
        } else {
            self.fail_run = self.fail_run.saturating_add(1);
            self.ok_run = 0;
        }
        if healthy {
            return if self.fail_run >= cfg.failure_threshold {
                Verdict::Down
            } else {
                Verdict::Keep
            };
        }
        if good && (!self.ever_healthy || self.ok_run >= cfg.success_threshold) {
            self.ever_healthy = true;
            return Verdict::Up;
        }
        if !good && self.fail_run == cfg.failure_threshold {
            // Reported once per outage (the worker is already out of rotation).
            return Verdict::Down;
        }
        Verdict::Keep
    }
}

/// The wait before the next check: the configured interval while healthy, at most the
/// unhealthy interval otherwise; a worker still in rotation whose last check failed
/// (`suspect`) is checked again after a quarter of that (at least 50 ms), so that a dead
/// engine is out within about one interval however the threshold counts, without more
/// checks while all is well.
pub fn next_check_in(cfg: &HealthConfig, healthy: bool, suspect: bool) -> Duration {
    if healthy && suspect {
        (cfg.interval().min(cfg.unhealthy_interval()) / 4)
            .max(Duration::from_millis(50))
            .min(cfg.interval())
    } else if healthy {
        cfg.interval()
    } else {
        cfg.interval().min(cfg.unhealthy_interval())
    }
}

/// Whether an engine's server info lets it serve as `role`: `Ok` with its DP size (when it
/// reports one), or why it is refused: a DP size past the bound, or a
/// `disaggregation_mode` other than its role (an engine that does not report one is
/// taken at its word).
pub fn admit_info(role: Role, info: &crate::engine::ServerInfo) -> Result<Option<u32>, String> {
    if let Some(mode) = info.disaggregation_mode.as_deref() {
        if mode != role.disaggregation_mode() {
            return Err(format!(
                "the engine reports disaggregation_mode {mode}, but it was added as a {role}"
            ));
        }
    }
    match info.dp_size.filter(|d| *d >= 1).map(client::checked_dp) {
        Some(Err(e)) => Err(e.to_string()),
        Some(Ok(dp)) => Ok(Some(dp)),
        None => Ok(None),
    }
}

/// Starts the health checker of one worker (and its server-info reader); it ends when the
/// worker leaves the pool. Each check reads the health settings of the live config.
///
/// `require_info`: the worker is not admitted before its `/server_info` answered (workers
/// added at run time: by the admin API, discovery or a reload), so that nothing routes to
/// an engine whose role and layout are unknown.
pub fn spawn(
    pool: Arc<Pool>,
    up: Upstream,
    live: LiveConfig,
    role: Role,
    id: WorkerId,
    url: BaseUrl,
    require_info: bool,
) {
    let p2 = pool.clone();
    p2.spawn_task(role, id, async move {
        let mut run = HealthRun::default();
        let mut have_info = false;
        // Refused at the last read: read again at every good check (it is out of rotation
        // anyway), so that a restart as another engine no check saw down is caught too.
        let mut refused = false;
        let mut ever_up = false;
        let conns = pool.with_worker(role, id, |w| w.shared().conns.clone());
        loop {
            let (cfg, bcfg) = {
                let c = live.load();
                (c.health.clone(), c.bootstrap.clone())
            };
            // Why a check failed, for the line that says the worker is down.
            let (good, mut why) = match up.get(&url, "/health", cfg.timeout()).await {
                Ok((s, _)) if s.is_success() => (true, None),
                Ok((s, _)) => (false, Some(format!("GET /health answered {}", s.as_u16()))),
                Err(e) => (false, Some(format!("GET /health failed: {e}"))),
            };
            if good && (!have_info || refused) {
                if let Ok(info) = client::server_info(&up, &url, bcfg.http_timeout()).await {
                    have_info = true;
                    let verdict = admit_info(role, &info);
                    refused = verdict.is_err();
                    let caps = info.max_running_per_dp.clone();
                    pool.update_worker(role, id, |w| {
                        match &verdict {
                            Err(why) => {
                                if w.facts.refused.as_deref() != Some(why.as_str()) {
                                    tracing::error!(worker_id = %WorkerIdent::new(role, id), worker_url = %w.shared().url, reason = %why, "worker refused");
                                }
                                w.facts.refused = Some(why.clone());
                            }
                            Ok(dp) => {
                                if w.facts.refused.take().is_some() {
                                    tracing::info!(worker_id = %WorkerIdent::new(role, id), worker_url = %w.shared().url, "worker no longer refused");
                                }
                                if let (Some(dp), Role::Decode | Role::Regular) = (dp, role) {
                                    w.facts.dp_size = Some(*dp);
                                }
                            }
                        }
                        w.facts.info = Some(Arc::new(info));
                    });
                    if role == Role::Decode {
                        capacity::seed(&pool, role, id, &caps);
                    }
                    pool.warn_mismatches();
                }
            }
            // Idle leg connections past their timeout are closed here, off the request path.
            if let Some(conns) = &conns {
                conns.sweep(up.legs.idle_timeout);
            }
            let Some(healthy) = pool.with_worker(role, id, |w| w.facts.healthy) else {
                return; // the worker left the pool
            };
            // Without its server info yet, a worker that must have it counts as down.
            if good && !have_info && require_info {
                why = Some("its /server_info has not answered yet".to_string());
            }
            let good = good && (have_info || !require_info);
            let verdict = run.observe(good, healthy, &cfg);
            if verdict != Verdict::Keep {
                let good = verdict == Verdict::Up;
                let reason = why.as_deref().unwrap_or("-");
                pool.update_worker(role, id, |w| {
                    let first = !w.facts.health_checked;
                    w.facts.healthy = good;
                    w.facts.health_checked = true;
                    // `pdgate_worker_healthy` is read from the pool at scrape time.
                    // A worker up at its first check at INFO; one down at its first check
                    // (an engine down when pdgate starts, or added before it runs) and
                    // every later change at WARN, a worker down with the reason.
                    let ident = WorkerIdent::new(role, id);
                    match (first, good) {
                        (true, true) => tracing::info!(worker_id = %ident, worker_url = %w.shared().url, "worker is up"),
                        (_, false) => tracing::warn!(worker_id = %ident, worker_url = %w.shared().url, reason, "worker is down"),
                        (false, true) => tracing::warn!(worker_id = %ident, worker_url = %w.shared().url, "worker is up again"),
                    }
                    // Up after being down (a restart), or up for the first time while its
                    // bootstrap port is still unknown (down at start): its bootstrap
                    // tracker reads the port and the rank routes now.
                    if good && role == Role::Prefill && (ever_up || w.facts.bootstrap.is_none()) {
                        w.shared().refresh.notify_one();
                    }
                });
                ever_up |= good;
            }
            let healthy = match verdict {
                Verdict::Up => true,
                Verdict::Down => false,
                Verdict::Keep => healthy,
            };
            // An engine that failed a check may come back as another engine (a restart
            // with another --dp-size or role): its server info is read again at its next
            // good check.
            if !good {
                have_info = false;
            }
            tokio::time::sleep(next_check_in(&cfg, healthy, !good)).await;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ServerInfo;

    #[test]
    fn server_info_admits_or_refuses() {
        let info = |mode: Option<&str>, dp: Option<u32>| ServerInfo {
            disaggregation_mode: mode.map(str::to_string),
            dp_size: dp,
            ..ServerInfo::default()
        };
        let table = [
            (Role::Prefill, info(Some("prefill"), Some(4)), Ok(Some(4))),
            (Role::Decode, info(Some("decode"), None), Ok(None)),
            (Role::Decode, info(None, Some(2)), Ok(Some(2))),
            (Role::Decode, info(Some("decode"), Some(0)), Ok(None)),
            (
                Role::Prefill,
                info(Some("decode"), Some(1)),
                Err("disaggregation_mode decode"),
            ),
            (
                Role::Decode,
                info(Some("null"), Some(1)),
                Err("disaggregation_mode null"),
            ),
            (
                Role::Decode,
                info(Some("decode"), Some(100_000)),
                Err("dp_size"),
            ),
        ];
        for (role, i, want) in table {
            let got = admit_info(role, &i);
            match (&got, want) {
                (Ok(a), Ok(b)) => assert_eq!(*a, b, "{role} {i:?}"),
                (Err(e), Err(part)) => assert!(e.contains(part), "{role} {i:?}: {e}"),
                _ => panic!("{role} {i:?}: got {got:?}, want {want:?}"),
            }
        }
    }

    /// SGLang router's defaults, which operators copy when they swap routers.
    fn sglang_flags() -> HealthConfig {
        HealthConfig {
            interval_secs: 60.0,
            timeout_secs: 5.0,
            failure_threshold: 3,
            success_threshold: 2,
            ..HealthConfig::default()
        }
    }

    /// Feeds a sequence of check results from a starting state; returns the health after
    /// each check.
    fn run(cfg: &HealthConfig, checks: &str) -> String {
        let mut r = HealthRun::default();
        let mut healthy = false;
        checks
            .chars()
            .map(|c| {
                match r.observe(c == '+', healthy, cfg) {
                    Verdict::Up => healthy = true,
                    Verdict::Down => healthy = false,
                    Verdict::Keep => {}
                }
                if healthy {
                    'H'
                } else {
                    '.'
                }
            })
            .collect()
    }

    #[test]
    fn thresholds_table() {
        let sg = sglang_flags();
        let def = HealthConfig::default();
        let cases: &[(&HealthConfig, &str, &str)] = &[
            // The first good check admits at once, whatever the success threshold.
            (&sg, "+", "H"),
            (&sg, "--+", "..H"),
            // Out after 3 failures in a row; back after 2 good checks in a row.
            (&sg, "+--+---++", "HHHHHH..H"),
            (&sg, "+---+-++", "HHH....H"),
            (&def, "+--+", "HH.H"),
            (&def, "+-+-+", "HHHHH"),
        ];
        for (cfg, checks, want) in cases {
            assert_eq!(&run(cfg, checks), want, "{checks}");
        }
    }

    #[test]
    fn unhealthy_workers_are_probed_sooner() {
        let sg = sglang_flags();
        assert_eq!(next_check_in(&sg, true, false), Duration::from_secs(60));
        assert_eq!(next_check_in(&sg, false, false), Duration::from_secs(1));
        // A failed check while still in rotation: again after a quarter.
        assert_eq!(next_check_in(&sg, true, true), Duration::from_millis(250));
        // Never slower than the healthy interval.
        let fast = HealthConfig {
            interval_secs: 0.5,
            ..HealthConfig::default()
        };
        assert_eq!(
            next_check_in(&fast, false, false),
            Duration::from_millis(500)
        );
        assert_eq!(next_check_in(&fast, true, true), Duration::from_millis(125));
        let def = HealthConfig::default();
        assert_eq!(next_check_in(&def, false, false), Duration::from_secs(1));
        assert_eq!(next_check_in(&def, true, true), Duration::from_millis(250));
        assert_eq!(next_check_in(&def, true, false), Duration::from_secs(1));
    }
}
