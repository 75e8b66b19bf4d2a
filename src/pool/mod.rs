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
//! - A worker is one [`Worker`] in the master list: its identity and life-long handles
//!   ([`WorkerShared`], never changed), its per-rank handles ([`RankHandles`], replaced
//!   whole only when its DP size changes) and its [`WorkerFacts`] (the only part a
//!   writer's closure changes). A snapshot's [`WorkerView`] holds the same two `Arc`s and
//!   a copy of the facts (the `worker` module says who writes what).
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

pub mod backlog;
pub mod breaker;
mod build;
pub mod capacity;
pub mod freshness;
pub mod groups;
pub mod mismatch;
mod origin;
mod ranks;
pub mod replicas;
mod series;
pub mod signals;
pub mod stats;
pub mod tally;
mod worker;

pub use breaker::{Breaker, BreakerState, TrialGuard};
pub use capacity::{CapacitySignal, RankCapacity, Reservation};
pub use freshness::RankFreshness;
pub use groups::{Group, ModelView};
pub use origin::{Drain, DrainBy, PodRef, WorkerSource};
pub use ranks::{PreflightOutcome, Probe, RankFailure, RankProbes, RankReadiness};
pub use stats::WorkerStats;
pub use worker::{
    BootstrapInfo, LostEpochs, RankHandles, Worker, WorkerFacts, WorkerShared, WorkerView,
};

use crate::engine::HandoffKey;
use crate::types::{role_index, DpRank, Role, WorkerId};
use crate::upstream::BaseUrl;

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
            Some(w) if w.shared.id == id => Some(w),
            _ => list
                .binary_search_by_key(&id, |w| w.shared.id)
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
        let loads = &view.per_rank.loads;
        if let Some(c) = loads.get(rank) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        LoadGuard {
            loads: loads.clone(),
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
    /// How many replicas share each decode rank's capacity (see [`replicas`]).
    replicas: replicas::Replicas,
    /// A snapshot rebuild was handed to a task and has not started yet (breaker
    /// transitions: see [`breaker`]).
    rebuild_pending: std::sync::atomic::AtomicBool,
    /// Held while a breaker of a role is checked against the ejection cap and opened, so
    /// that two failures at once cannot both pass the check (failure path only).
    eject_lock: Mutex<()>,
    /// The scaling signals the sampler published last ([`signals`]), rendered at scrape
    /// time.
    signals: ArcSwap<Vec<signals::ModelSignals>>,
}

#[derive(Default)]
struct Master {
    workers: Vec<Worker>,
    /// The next id of each role (prefill, decode, regular): ids are never reused.
    next: [u32; 3],
}

impl Pool {
    pub fn new() -> Pool {
        let capacity = Arc::new(CapacitySignal::default());
        Pool {
            snap: ArcSwap::from_pointee(Snapshot::default()),
            master: Mutex::new(Master::default()),
            replicas: replicas::Replicas::new(capacity.clone()),
            capacity,
            rebuild_pending: std::sync::atomic::AtomicBool::new(false),
            eject_lock: Mutex::new(()),
            signals: ArcSwap::from_pointee(Vec::new()),
        }
    }

    /// The scaling signals published last (empty before the sampler's first tick).
    pub fn signals(&self) -> Arc<Vec<signals::ModelSignals>> {
        self.signals.load_full()
    }

    /// Publishes the sampler's figures (see [`signals`]).
    pub fn publish_signals(&self, s: Vec<signals::ModelSignals>) {
        self.signals.store(Arc::new(s));
    }

    /// Wakes requests waiting for a decode slot (see [`capacity`]).
    pub fn capacity_signal(&self) -> &Arc<CapacitySignal> {
        &self.capacity
    }

    /// The replica count admission shares each decode rank's capacity by (see [`replicas`]).
    pub fn replicas(&self) -> &replicas::Replicas {
        &self.replicas
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
            res = match m.find(role, |w| w.shared.url == url) {
                Some(w) => Err(w.shared.id),
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
            if let Some(i) = m.workers.iter().position(|w| w.is(role, id)) {
                let w = m.workers.remove(i);
                w.shared.stop.cancel();
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
            let drain = &mut w.facts.drain;
            match by {
                DrainBy::Operator => drain.operator = on,
                DrainBy::Unready => drain.unready = on,
                DrainBy::Leaving => drain.leaving = on,
            }
        });
        found
    }

    /// Sets (or clears) the operator's model name for a worker; false if unknown.
    pub fn set_model(&self, role: Role, id: WorkerId, model: Option<Arc<str>>) -> bool {
        let mut found = false;
        self.update_worker(role, id, |w| {
            found = true;
            w.facts.model_override = model;
        });
        found
    }

    /// The worker of `role` at `url`, if any.
    pub fn find(&self, role: Role, url: &BaseUrl) -> Option<WorkerId> {
        let m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        m.find(role, |w| w.shared.url == *url).map(|w| w.shared.id)
    }

    /// Runs `task` until it ends or the worker leaves the pool. Nothing runs when the
    /// worker is already gone.
    pub fn spawn_task<F>(&self, role: Role, id: WorkerId, task: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let Some(stop) = self.with_worker(role, id, |w| w.shared.stop.clone()) else {
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
    pub fn update_worker(&self, role: Role, id: WorkerId, f: impl FnOnce(&mut Worker)) {
        self.update_worker_if(role, id, |w| {
            f(w);
            true
        });
    }

    /// Mutates one worker under the writer lock; publishes a new snapshot only when `f`
    /// says one of its facts changed (a snapshot shows them all) or the DP size did (new
    /// per-rank handles). Returns whether it published.
    pub fn update_worker_if(
        &self,
        role: Role,
        id: WorkerId,
        f: impl FnOnce(&mut Worker) -> bool,
    ) -> bool {
        let mut m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        let Some(w) = m.workers.iter_mut().find(|w| w.is(role, id)) else {
            return false;
        };
        let mut changed = f(w);
        let dp = w.facts.effective_dp();
        if w.per_rank.loads.len() != dp as usize {
            // The only writer of `per_rank`: new handles for the new DP size.
            w.per_rank = Arc::new(RankHandles::new(dp));
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
        f: impl FnOnce(&Worker) -> T,
    ) -> Option<T> {
        let m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        m.find(role, |w| w.shared.id == id).map(f)
    }

    fn update_master(&self, f: impl FnOnce(&mut Master)) {
        let mut m = self.master.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut m);
        self.publish(&m);
    }

    /// Builds and swaps in a new snapshot (the caller holds the writer lock).
    fn publish(&self, m: &Master) {
        // Every decode rank's place in the turn of the remainder slots of a known replica
        // count (`capacity::share`): its position among all decode ranks in URL order,
        // which every replica that sees the same decodes computes alike.
        let mut decodes: Vec<&Worker> = m
            .workers
            .iter()
            .filter(|w| w.shared.role == Role::Decode)
            .collect();
        decodes.sort_by(|a, b| a.shared.url.as_str().cmp(b.shared.url.as_str()));
        let mut turn = 0u32;
        for w in decodes {
            for r in w.per_rank.capacity.iter() {
                r.set_turn(turn);
                turn = turn.wrapping_add(1);
            }
        }
        let version = self.snap.load().version + 1;
        self.snap
            .store(Arc::new(build::snapshot(&m.workers, version)));
        // A worker may have joined or come back: requests waiting for a slot look again.
        self.capacity.wake();
    }
}

impl Master {
    /// The first worker of `role` that `pred` accepts.
    fn find(&self, role: Role, pred: impl Fn(&Worker) -> bool) -> Option<&Worker> {
        self.workers
            .iter()
            .find(|w| w.shared.role == role && pred(w))
    }

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
        self.workers
            .push(Worker::new(id, role, url, bootstrap, source));
        id
    }
}

impl Default for Pool {
    fn default() -> Self {
        Pool::new()
    }
}
