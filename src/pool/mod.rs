//! The worker pools: one immutable [`Snapshot`] read lock-free on the request path, rebuilt
//! whole and swapped by the background tasks that learn about workers.
//!
//! Invariants:
//! - The request path only `load()`s the `ArcSwap`; it never locks.
//! - Writes go through [`Pool::update_worker`] (and the other writers), which serialises writers on a mutex that the
//!   request path never touches, mutates the master state, and publishes a new snapshot.
//!   There is therefore exactly one writer of the snapshot at a time.
//! - A (worker, rank) is *routable* only when the worker is healthy and, for a prefill,
//!   its bootstrap rank is `Ready`. The routable target lists are computed at rebuild time
//!   so that a policy picks from them without allocating.
//! - In-flight counters live in `Arc<[AtomicU64]>` carried across rebuilds; a
//!   [`LoadGuard`] holds its counter until dropped (when the response body ends).
//! - Workers come and go (static config, hot reload, the admin API, Kubernetes discovery).
//!   A [`WorkerId`] is never reused within its role, so a stale id names no worker rather
//!   than the wrong one; a snapshot's worker lists are sorted by id. A `draining` worker
//!   takes no new request, and its in-flight ones finish; removing a worker cancels its
//!   background tasks (the ones started by [`Pool::spawn_task`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

pub mod breaker;
mod build;
pub mod capacity;
pub mod freshness;
pub mod groups;
pub mod mismatch;
mod origin;
mod ranks;
mod series;
pub mod stats;

pub use breaker::{Breaker, BreakerState, TrialGuard};
pub use capacity::{CapacitySignal, RankCapacity, Reservation};
pub use freshness::RankFreshness;
pub use groups::{Group, ModelView};
pub use origin::{Drain, DrainBy, PodRef, WorkerSource};
pub use ranks::{PreflightOutcome, Probe, RankFailure, RankProbes, RankReadiness};
pub use stats::WorkerStats;
use tokio::sync::watch;

use crate::engine::{HandoffKey, Layout, ServerInfo};
use crate::progress::WorkerProgress;
use crate::types::{role_index, DpRank, Role, WorkerId};
use crate::upstream::{BaseUrl, HostConns};

/// A prefill's bootstrap server as decode engines reach it.
#[derive(Clone, Debug)]
pub struct BootstrapInfo {
    /// Where pdgate polls it.
    pub url: BaseUrl,
    /// `bootstrap_host` as a JSON string literal, ready to write on legs.
    pub host_json: String,
    pub port: u16,
}

/// Mutable state of one worker, owned by the writer.
#[derive(Debug)]
pub struct WorkerState {
    pub id: WorkerId,
    pub role: Role,
    pub url: BaseUrl,
    pub source: Arc<WorkerSource>,
    /// Takes no new request while any reason holds; requests in flight finish.
    pub drain: Drain,
    /// Cancelled when the worker leaves the pool: ends its background tasks.
    pub stop: CancellationToken,
    pub healthy: bool,
    pub health_checked: bool,
    pub dp_size: Option<u32>,
    pub loads: Arc<[AtomicU64]>,
    /// Engine-reported load per DP rank (requests running + waiting, from `/v1/loads`
    /// or `/get_load`); all 0 while not polled. Written by the load poller in place.
    pub engine_load: Arc<[AtomicU64]>,
    /// Capacity per DP rank (decode): the engine's figures, written in place by the load
    /// poller and the health checker, and this replica's reservations (`capacity`).
    pub capacity: Arc<[RankCapacity]>,
    /// Prefill only.
    pub bootstrap: Option<BootstrapInfo>,
    pub layout: Option<Layout>,
    pub ranks: Vec<RankReadiness>,
    /// When each rank was last confirmed (atomics: no rebuild per confirmation).
    pub fresh: Arc<RankFreshness>,
    /// Wakes the prefill's bootstrap tracker for a re-read of its rank routes (a signal:
    /// a failed leg or preflight, a restart, a layout change). Coalesced.
    pub refresh: Arc<tokio::sync::Notify>,
    /// Bumped when the prefill (or one of its ranks) is lost; in-flight requests on it
    /// whose prefill has not answered yet watch this.
    pub lost_tx: watch::Sender<LostEpochs>,
    /// The engine's `/server_info` facts, once read.
    pub info: Option<ServerInfo>,
    /// The model clients name for this worker, set by the operator (config, admin API):
    /// wins over what the engine reports.
    pub model: Option<Arc<str>>,
    /// Passive health of this worker's leg.
    pub breaker: Arc<Breaker>,
    /// Kept-alive connections for this worker's legs.
    pub conns: Arc<HostConns>,
    /// Why the worker can never take a leg (e.g. a DP size above the limit); never
    /// routable while set.
    pub refused: Option<String>,
    /// Why the prefill's bootstrap server is not its own (`crate::bootstrap::ownership`);
    /// kept apart from `refused`, which the health checker sets and clears from
    /// `/server_info` alone. Never routable while set.
    pub bootstrap_refused: Option<String>,
    /// Request-path rank checks in flight (prefill only).
    pub probes: Arc<RankProbes>,
    /// Learned leg times and progress (stall detection), per DP rank.
    pub progress: Arc<WorkerProgress>,
    /// Leg outcomes and times, for `/metrics` ([`stats`]).
    pub stats: Arc<WorkerStats>,
}

/// Loss counters of one prefill, in one channel so that a request in flight waits on a
/// single signal: `heartbeat` is bumped when the prefill's bootstrap server is lost,
/// `ranks[k]` when DP rank `k` stops being ready.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct LostEpochs {
    pub heartbeat: u64,
    pub ranks: Vec<u64>,
}

impl LostEpochs {
    pub fn rank(&self, k: usize) -> u64 {
        self.ranks.get(k).copied().unwrap_or(0)
    }
}

/// An immutable view of one worker inside a snapshot.
#[derive(Debug)]
pub struct WorkerView {
    pub id: WorkerId,
    pub role: Role,
    pub url: BaseUrl,
    pub source: Arc<WorkerSource>,
    /// Out of rotation for one of [`Drain`]'s reasons.
    pub draining: bool,
    /// Being removed (drains, then leaves the pool).
    pub leaving: bool,
    pub healthy: bool,
    pub dp_size: Option<u32>,
    pub loads: Arc<[AtomicU64]>,
    pub engine_load: Arc<[AtomicU64]>,
    pub capacity: Arc<[RankCapacity]>,
    pub bootstrap: Option<BootstrapInfo>,
    pub layout: Option<Layout>,
    pub ranks: Vec<RankReadiness>,
    pub fresh: Arc<RankFreshness>,
    pub refresh: Arc<tokio::sync::Notify>,
    pub lost: watch::Receiver<LostEpochs>,
    pub breaker: Arc<Breaker>,
    pub conns: Arc<HostConns>,
    pub refused: Option<String>,
    pub probes: Arc<RankProbes>,
    pub progress: Arc<WorkerProgress>,
    pub stats: Arc<WorkerStats>,
    /// The engine streams `/generate` incrementally (`/server_info`
    /// `incremental_streaming_output`), not SGLang's default cumulative text.
    pub incremental_stream: bool,
    /// Its handoff group (index into `Snapshot::groups`): it pairs only within it.
    pub group: usize,
    /// The model it serves, when known (override, else what the engine reports).
    pub model: Option<Arc<str>>,
}

impl WorkerView {
    /// The DP size legs are planned with: the prefill's bootstrap layout, the decode's
    /// server info, else 1.
    pub fn effective_dp(&self) -> u32 {
        match (&self.layout, self.dp_size) {
            (Some(l), _) => l.dp_size.max(1),
            (None, Some(d)) => d.max(1),
            (None, None) => 1,
        }
    }

    /// Requests pdgate has in flight on the worker, all ranks together.
    pub fn in_flight_total(&self) -> u64 {
        self.loads
            .iter()
            .fold(0u64, |a, c| a.saturating_add(c.load(Ordering::Relaxed)))
    }

    /// Requests pdgate has in flight on `rank`.
    pub fn in_flight(&self, rank: DpRank) -> u64 {
        self.loads
            .get(rank as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The engine's own last reported load on `rank` (0 when not polled).
    pub fn engine_load(&self, rank: DpRank) -> u64 {
        self.engine_load
            .get(rank as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The capacity state of `rank`.
    pub fn capacity(&self, rank: DpRank) -> Option<&RankCapacity> {
        self.capacity.get(rank as usize)
    }
}

/// Everything the request path needs, published whole.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub prefills: Vec<WorkerView>,
    pub decodes: Vec<WorkerView>,
    /// Regular (non-PD) workers: each runs whole requests (SGLang's plain mode).
    pub regulars: Vec<WorkerView>,
    /// Routable prefill workers, each with its routable DP ranks.
    pub prefill_routable: Vec<Routable>,
    /// Routable decode workers, each with its routable DP ranks.
    pub decode_routable: Vec<Routable>,
    /// Routable regular workers, each with its DP ranks.
    pub regular_routable: Vec<Routable>,
    /// Handoff groups (see [`groups`]): a prefill and a decode pair only within one.
    pub groups: Vec<Group>,
    /// The models served, by the name clients use, in first-seen order.
    pub models: Vec<ModelView>,
    /// Routable prefills whose handoff group has a routable decode (what a request
    /// naming no model picks from while several groups exist).
    pub prefill_pairable: Vec<Routable>,
    pub version: u64,
}

/// A worker that can take a leg now, and which of its DP ranks can.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routable {
    pub worker: WorkerId,
    pub ranks: Vec<DpRank>,
}

impl Snapshot {
    pub fn worker(&self, role: Role, id: WorkerId) -> Option<&WorkerView> {
        let list = self.workers(role);
        // Sorted by id (ids only grow); without removals the id is the index.
        match list.get(id.0 as usize) {
            Some(w) if w.id == id => Some(w),
            _ => list
                .binary_search_by_key(&id, |w| w.id)
                .ok()
                .and_then(|i| list.get(i)),
        }
    }

    /// Every worker of a role.
    pub fn workers(&self, role: Role) -> &[WorkerView] {
        match role {
            Role::Prefill => &self.prefills,
            Role::Decode => &self.decodes,
            Role::Regular => &self.regulars,
        }
    }

    pub fn routable(&self, role: Role) -> &[Routable] {
        match role {
            Role::Prefill => &self.prefill_routable,
            Role::Decode => &self.decode_routable,
            Role::Regular => &self.regular_routable,
        }
    }

    /// The model named `name` (exactly), if any worker serves it.
    pub fn model(&self, name: &str) -> Option<&ModelView> {
        self.models.iter().find(|m| &*m.name == name)
    }

    /// The routable workers of `role` a request for `model` may use (`None`: any model;
    /// with several handoff groups, only prefills that have a partner).
    pub fn routable_for(&self, role: Role, model: Option<&str>) -> &[Routable] {
        match model {
            None if role == Role::Prefill && self.groups.len() > 1 => &self.prefill_pairable,
            None => self.routable(role),
            Some(name) => match (self.model(name), role) {
                (Some(m), Role::Prefill) => &m.prefill_routable,
                (Some(m), Role::Decode) => &m.decode_routable,
                (Some(m), Role::Regular) => &m.regular_routable,
                (None, _) => &[],
            },
        }
    }

    /// The routable workers of `role` that may pair with a worker of handoff group
    /// `group` (its compatible groups'): `None` while there is only one group (every
    /// routable worker may).
    pub fn partners(&self, role: Role, group: usize) -> Option<&[Routable]> {
        if self.groups.len() <= 1 {
            return None;
        }
        Some(self.groups.get(group).map_or(&[], |g| match role {
            Role::Prefill => &g.partner_prefills,
            Role::Decode => &g.partner_decodes,
            // Regular workers hand off nothing: they pair with no one.
            Role::Regular => &[],
        }))
    }

    /// The routable decodes that may pair with `prefill` (see [`Self::partners`]).
    pub fn decodes_for(&self, prefill: WorkerId) -> Option<&[Routable]> {
        if self.groups.len() <= 1 {
            return None;
        }
        let Some(w) = self.worker(Role::Prefill, prefill) else {
            return Some(&[]);
        };
        self.partners(Role::Decode, w.group)
    }

    /// Number of routable (worker, rank)s of a role.
    pub fn routable_ranks(&self, role: Role) -> usize {
        self.routable(role).iter().map(|r| r.ranks.len()).sum()
    }
}

/// Holds one in-flight unit on a (worker, rank) until dropped, and with it the decode
/// slot reserved for the request, if any (see [`capacity`]).
#[derive(Debug)]
pub struct LoadGuard {
    loads: Arc<[AtomicU64]>,
    rank: usize,
    reservation: Option<Reservation>,
}

impl LoadGuard {
    pub fn new(view: &WorkerView, rank: DpRank) -> LoadGuard {
        let rank = rank as usize;
        if let Some(c) = view.loads.get(rank) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        LoadGuard {
            loads: view.loads.clone(),
            rank,
            reservation: None,
        }
    }

    /// The guard, also holding a decode slot until it drops.
    pub fn with_reservation(mut self, r: Option<Reservation>) -> LoadGuard {
        self.reservation = r;
        self
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        if let Some(c) = self.loads.get(self.rank) {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The pools and their single-writer master state.
pub struct Pool {
    snap: ArcSwap<Snapshot>,
    master: Mutex<Master>,
    capacity: Arc<CapacitySignal>,
    /// A snapshot rebuild was handed to a task and has not started yet (breaker
    /// transitions: see [`breaker`]).
    rebuild_pending: std::sync::atomic::AtomicBool,
    /// Held while a breaker of a role is checked against the ejection cap and opened, so
    /// that two failures at once cannot both pass the check (failure path only).
    eject_lock: Mutex<()>,
}

#[derive(Default)]
struct Master {
    workers: Vec<WorkerState>,
    /// The next id of each role (prefill, decode, regular): ids are never reused.
    next: [u32; 3],
}

fn new_loads(dp: u32) -> Arc<[AtomicU64]> {
    (0..dp.max(1)).map(|_| AtomicU64::new(0)).collect()
}

impl Pool {
    pub fn new() -> Pool {
        Pool {
            snap: ArcSwap::from_pointee(Snapshot::default()),
            master: Mutex::new(Master::default()),
            capacity: Arc::new(CapacitySignal::default()),
            rebuild_pending: std::sync::atomic::AtomicBool::new(false),
            eject_lock: Mutex::new(()),
        }
    }

    /// Wakes requests waiting for a decode slot (see [`capacity`]).
    pub fn capacity_signal(&self) -> &Arc<CapacitySignal> {
        &self.capacity
    }

    /// The current snapshot (lock-free).
    pub fn load(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.snap.load()
    }

    pub fn load_full(&self) -> Arc<Snapshot> {
        self.snap.load_full()
    }

    /// Adds a static worker; returns its id (its index within its role while no worker
    /// was removed).
    pub fn add_worker(
        &self,
        role: Role,
        url: BaseUrl,
        bootstrap: Option<BootstrapInfo>,
    ) -> WorkerId {
        self.add_worker_from(role, url, bootstrap, WorkerSource::Static)
    }

    /// Adds a worker from `source`; returns its id, never used before in its role.
    pub fn add_worker_from(
        &self,
        role: Role,
        url: BaseUrl,
        bootstrap: Option<BootstrapInfo>,
        source: WorkerSource,
    ) -> WorkerId {
        let mut id = WorkerId(0);
        self.update_master(|m| id = m.insert(role, url, bootstrap, source));
        id
    }

    /// Adds a worker unless its role already has one at `url`, in one step under the
    /// writer lock (two callers adding one URL at once add it once): `Err` holds the
    /// existing worker's id.
    pub fn add_worker_unique(
        &self,
        role: Role,
        url: BaseUrl,
        source: WorkerSource,
    ) -> Result<WorkerId, WorkerId> {
        let mut res = Err(WorkerId(0));
        self.update_master(|m| {
            res = match m.workers.iter().find(|w| w.role == role && w.url == url) {
                Some(w) => Err(w.id),
                None => Ok(m.insert(role, url, None, source)),
            };
        });
        res
    }

    /// Removes a worker and cancels its background tasks; its requests in flight keep
    /// what they hold (views, counters, connections) until they end. False if unknown.
    pub fn remove_worker(&self, role: Role, id: WorkerId) -> bool {
        let mut found = false;
        self.update_master(|m| {
            if let Some(i) = m.workers.iter().position(|w| w.role == role && w.id == id) {
                let w = m.workers.remove(i);
                w.stop.cancel();
                found = true;
            }
        });
        found
    }

    /// Sets or clears one reason for a worker to drain (no new requests while any holds);
    /// false if unknown.
    pub fn set_drain(&self, role: Role, id: WorkerId, by: DrainBy, on: bool) -> bool {
        let mut found = false;
        self.update_worker(role, id, |w| {
            found = true;
            match by {
                DrainBy::Operator => w.drain.operator = on,
                DrainBy::Unready => w.drain.unready = on,
                DrainBy::Leaving => w.drain.leaving = on,
            }
        });
        found
    }

    /// Sets (or clears) the operator's model name for a worker; false if unknown.
    pub fn set_model(&self, role: Role, id: WorkerId, model: Option<Arc<str>>) -> bool {
        let mut found = false;
        self.update_worker(role, id, |w| {
            found = true;
            w.model = model;
        });
        found
    }

    /// The worker of `role` at `url`, if any.
    pub fn find(&self, role: Role, url: &BaseUrl) -> Option<WorkerId> {
        let m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        m.workers
            .iter()
            .find(|w| w.role == role && w.url == *url)
            .map(|w| w.id)
    }

    /// Runs `task` until it ends or the worker leaves the pool. Nothing runs when the
    /// worker is already gone.
    pub fn spawn_task<F>(&self, role: Role, id: WorkerId, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let Some(stop) = self.with_worker(role, id, |w| w.stop.clone()) else {
            return;
        };
        tokio::spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = task => {}
            }
        });
    }

    /// Mutates one worker under the writer lock and publishes a new snapshot.
    pub fn update_worker(&self, role: Role, id: WorkerId, f: impl FnOnce(&mut WorkerState)) {
        self.update_worker_if(role, id, |w| {
            f(w);
            true
        });
    }

    /// Mutates one worker under the writer lock; publishes a new snapshot only when `f`
    /// says something the snapshot shows changed (or the DP size did). Returns whether
    /// it published.
    pub fn update_worker_if(
        &self,
        role: Role,
        id: WorkerId,
        f: impl FnOnce(&mut WorkerState) -> bool,
    ) -> bool {
        let mut m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        let Some(w) = m.workers.iter_mut().find(|w| w.role == role && w.id == id) else {
            return false;
        };
        let mut changed = f(w);
        let dp = w
            .layout
            .as_ref()
            .map(|l| l.dp_size)
            .or(w.dp_size)
            .unwrap_or(1)
            .max(1);
        if w.loads.len() != dp as usize {
            w.loads = new_loads(dp);
            w.engine_load = new_loads(dp);
            w.capacity = capacity::new_ranks(dp);
            w.probes = Arc::new(RankProbes::new(dp));
            w.progress = Arc::new(WorkerProgress::new(dp));
            w.fresh = Arc::new(RankFreshness::new(dp));
            changed = true;
        }
        if changed {
            self.publish(&m);
        }
        changed
    }

    /// Reads one worker's master state (background tasks only).
    pub fn with_worker<T>(
        &self,
        role: Role,
        id: WorkerId,
        f: impl FnOnce(&WorkerState) -> T,
    ) -> Option<T> {
        let m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        m.workers
            .iter()
            .find(|w| w.role == role && w.id == id)
            .map(f)
    }

    fn update_master(&self, f: impl FnOnce(&mut Master)) {
        let mut m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut m);
        self.publish(&m);
    }

    /// Builds and swaps in a new snapshot (the caller holds the writer lock).
    fn publish(&self, m: &Master) {
        let version = self.snap.load().version + 1;
        self.snap
            .store(Arc::new(build::snapshot(&m.workers, version)));
        // A worker may have joined or come back: requests waiting for a slot look again.
        self.capacity.wake();
    }
}

impl Master {
    /// Appends a new worker with the next id of its role.
    fn insert(
        &mut self,
        role: Role,
        url: BaseUrl,
        bootstrap: Option<BootstrapInfo>,
        source: WorkerSource,
    ) -> WorkerId {
        let next = &mut self.next[role_index(role)];
        let id = WorkerId(*next);
        *next = next.saturating_add(1);
        let (lost_tx, _) = watch::channel(LostEpochs::default());
        self.workers.push(WorkerState {
            id,
            role,
            source: Arc::new(source),
            drain: Drain::default(),
            stop: CancellationToken::new(),
            conns: Arc::new(HostConns::new(&url)),
            url,
            healthy: false,
            health_checked: false,
            dp_size: None,
            loads: new_loads(1),
            engine_load: new_loads(1),
            capacity: capacity::new_ranks(1),
            bootstrap,
            layout: None,
            ranks: Vec::new(),
            fresh: Arc::new(RankFreshness::new(1)),
            refresh: Arc::new(tokio::sync::Notify::new()),
            lost_tx,
            info: None,
            model: None,
            breaker: Arc::new(Breaker::default()),
            refused: None,
            bootstrap_refused: None,
            probes: Arc::new(RankProbes::new(1)),
            progress: Arc::new(WorkerProgress::new(1)),
            stats: Arc::default(),
        });
        id
    }
}

impl Default for Pool {
    fn default() -> Self {
        Pool::new()
    }
}
