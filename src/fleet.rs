//! Workers joining and leaving a running router: the one place that starts a worker's
//! background tasks (bootstrap tracker, health checker, load poller) and that drains and
//! removes it. The admin API, Kubernetes discovery and config reload all go through
//! [`Fleet`]; the static workers of the config at start do too.
//!
//! Invariants:
//! - A worker added at run time (not [`WorkerSource::Static`]) is routable only after its
//!   `/server_info` answered and its first health check passed (a prefill also needs its
//!   bootstrap layout and a ready rank, as every prefill does).
//! - Two run-time workers of one role never share a URL: adding one that exists is refused
//!   with the existing id (static config lists are taken as written).
//! - Draining takes a worker out of rotation at once (the next snapshot); requests in flight
//!   on it, and prefill legs it still runs, keep their counters and finish.
//! - Removal drains first and drops the worker when it has nothing in flight or at the
//!   deadline, whichever comes first; its tasks end with it.

use std::sync::Arc;
use std::time::Duration;

use crate::config::LiveConfig;
use crate::pool::{DrainBy, Pool, WorkerSource};
use crate::types::{Role, WorkerId, WorkerIdent};
use crate::upstream::{BaseUrl, Upstream};

/// A worker to add.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerSpec {
    pub role: Role,
    pub url: BaseUrl,
    /// Prefill only: the bootstrap server's port; unset, the engine's `/server_info`
    /// tells (else 8998).
    pub bootstrap_port: Option<u16>,
    /// Prefill only: the host decode engines reach the bootstrap server at; unset, the
    /// URL's host.
    pub bootstrap_host: Option<String>,
    pub source: WorkerSource,
    /// The model clients name for it (the operator's word); unset, its `/server_info`
    /// tells.
    pub model: Option<String>,
}

impl WorkerSpec {
    /// A worker from the config file or the command line with no bootstrap server of its
    /// own (a decode or a regular worker).
    pub fn static_plain(role: Role, url: BaseUrl, model: Option<String>) -> WorkerSpec {
        WorkerSpec {
            role,
            url,
            bootstrap_port: None,
            bootstrap_host: None,
            source: WorkerSource::Static,
            model,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum FleetError {
    #[error("a {role} worker at {url} already exists (id {id})")]
    Exists {
        role: Role,
        url: String,
        id: WorkerId,
    },
    #[error("no {role} worker with id {id}")]
    NotFound { role: Role, id: WorkerId },
}

/// How a removal ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removed {
    /// Nothing was in flight any more.
    Drained,
    /// The deadline passed with requests still in flight (they keep running on what they
    /// hold; the worker is gone from the pool).
    DeadlinePassed,
    /// Someone else removed it first.
    AlreadyGone,
}

/// Adds, drains and removes workers of one running router.
pub struct Fleet {
    pool: Arc<Pool>,
    up: Upstream,
    live: LiveConfig,
}

/// How often a draining worker's in-flight count is read.
const DRAIN_POLL: Duration = Duration::from_millis(50);

impl Fleet {
    pub fn new(pool: Arc<Pool>, up: Upstream, live: LiveConfig) -> Fleet {
        Fleet { pool, up, live }
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn live(&self) -> &LiveConfig {
        &self.live
    }

    /// Adds a worker and starts its tasks; returns its id.
    pub fn add(&self, spec: WorkerSpec) -> Result<WorkerId, FleetError> {
        let checked = spec.source != WorkerSource::Static;
        self.add_inner(spec, checked)
    }

    /// Adds a static worker at run time (a reload): like a run-time worker, it takes
    /// traffic only after its `/server_info` answered and its first health check passed.
    pub fn add_checked(&self, spec: WorkerSpec) -> Result<WorkerId, FleetError> {
        self.add_inner(spec, true)
    }

    fn add_inner(&self, spec: WorkerSpec, runtime: bool) -> Result<WorkerId, FleetError> {
        let WorkerSpec {
            role,
            url,
            bootstrap_port,
            bootstrap_host,
            source,
            model,
        } = spec;
        let label = source.label();
        // Run-time sources (admin API, discovery) may race to add one URL: the check and
        // the insert are one step under the pool's writer lock.
        let id = if source != WorkerSource::Static {
            self.pool
                .add_worker_unique(role, url.clone(), source)
                .map_err(|id| FleetError::Exists {
                    role,
                    url: url.to_string(),
                    id,
                })?
        } else {
            self.pool.add_worker_from(role, url.clone(), None, source)
        };
        if let Some(m) = model {
            self.pool.set_model(role, id, Some(m.into()));
        }
        tracing::info!(worker_id = %WorkerIdent::new(role, id), worker_url = %url, source = label, "worker added");
        if role == Role::Prefill {
            crate::bootstrap::tracker::spawn(
                self.pool.clone(),
                self.up.clone(),
                self.live.clone(),
                id,
                url.clone(),
                bootstrap_port,
                bootstrap_host,
            );
        }
        crate::health::spawn(
            self.pool.clone(),
            self.up.clone(),
            self.live.clone(),
            role,
            id,
            url.clone(),
            runtime,
        );
        // Always started: it follows `policy.load_poll_interval_ms` across reloads.
        crate::health::load::spawn(
            self.pool.clone(),
            self.up.clone(),
            self.live.clone(),
            role,
            id,
            url,
        );
        Ok(id)
    }

    /// An operator takes a worker out of rotation; its requests in flight finish.
    pub fn drain(&self, role: Role, id: WorkerId) -> Result<(), FleetError> {
        self.set_drain(role, id, DrainBy::Operator, true)
    }

    /// Undoes an operator's drain: back in rotation when healthy and no other reason to
    /// drain holds (an unready pod, a removal).
    pub fn undrain(&self, role: Role, id: WorkerId) -> Result<(), FleetError> {
        self.set_drain(role, id, DrainBy::Operator, false)
    }

    /// Sets or clears one reason to drain (discovery uses [`DrainBy::Unready`]).
    pub fn set_drain(
        &self,
        role: Role,
        id: WorkerId,
        by: DrainBy,
        on: bool,
    ) -> Result<(), FleetError> {
        if !self.pool.set_drain(role, id, by, on) {
            return Err(FleetError::NotFound { role, id });
        }
        let url = self
            .pool
            .load()
            .worker(role, id)
            .map(|w| w.shared.url.to_string());
        tracing::info!(worker_id = %WorkerIdent::new(role, id), worker_url = url.as_deref().unwrap_or("-"), draining = on, by = by.label(), "worker drain");
        Ok(())
    }

    /// Drains a worker, then removes it when it has nothing in flight or after `within`.
    /// The returned task ends when the worker is gone.
    pub fn remove(
        &self,
        role: Role,
        id: WorkerId,
        within: Duration,
    ) -> Result<tokio::task::JoinHandle<Removed>, FleetError> {
        self.set_drain(role, id, DrainBy::Leaving, true)?;
        let pool = self.pool.clone();
        Ok(tokio::spawn(async move {
            // `within` may come from outside (a pod's grace period): never overflow.
            let now = tokio::time::Instant::now();
            let deadline = now
                .checked_add(within)
                .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365));
            let how = loop {
                let busy = match pool.load().worker(role, id) {
                    None => break Removed::AlreadyGone,
                    Some(w) => w.in_flight_total(),
                };
                if busy == 0 {
                    break Removed::Drained;
                }
                if tokio::time::Instant::now() >= deadline {
                    break Removed::DeadlinePassed;
                }
                tokio::time::sleep(DRAIN_POLL).await;
            };
            let url = pool
                .load()
                .worker(role, id)
                .map(|w| w.shared.url.to_string());
            let how = if pool.remove_worker(role, id) {
                how
            } else {
                Removed::AlreadyGone
            };
            if let Some(url) = url {
                tracing::info!(worker_id = %WorkerIdent::new(role, id), worker_url = %url, outcome = ?how, "worker removed");
            }
            how
        }))
    }

    /// The worker of `role` at `url`, if any.
    pub fn find(&self, role: Role, url: &BaseUrl) -> Option<WorkerId> {
        self.pool.find(role, url)
    }
}
