//! Counters of one engine (`GET /sim/stats`, `SimEngine::stats`) and the
//! per-request drop guard that keeps them honest.
//!
//! Why: router tests assert on what the engines saw (rank placement, contract
//! violations, aborts); a counter that drifts would make those tests lie.
//!
//! Invariants:
//! - The unit is one *request instance* (one prompt × one sample, i.e. one
//!   bootstrap room); a batched HTTP request counts once per instance.
//! - Every instance is counted in `requests_total` when it starts and ends in
//!   exactly one of `ok`, `failed`, `aborted`, `client_disconnects`; so at
//!   any quiet moment `requests_total == ok + failed + aborted +
//!   client_disconnects`, `held_now == 0` and `kv_waiting_decodes == 0`. [`InstanceGuard`] enforces this:
//!   an instance dropped without an outcome counts as a client disconnect, or as
//!   failed if the engine was down (its connection was cut by the simulator).
//! - `contract_violations` is the sum of the three `violation_*` counters.
//! - Prefix caches (`crate::prefix_cache`): per DP rank, the cached tokens never exceed
//!   the prompt tokens looked up; a prefill counts in the `prefill_prefix_*` lists, a
//!   decode in the `decode_prefix_*` ones (the other role's lists stay empty), so that
//!   summing a cluster's engines keeps the roles apart.
//! - The load gauges per DP rank (`/v1/loads`, `/get_load`) are exact at any quiet moment
//!   too: an instance is in at most one phase (waiting, running, or a prefill's inflight),
//!   a decode's pre-allocation count is a subset of its waiting count, and a prefill's
//!   queued uncached tokens are what its queued instances added; the guard takes back
//!   whatever it added when it drops, so every gauge returns to 0.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::config::Role;

/// A point-in-time copy of an engine's counters (same JSON as `GET /sim/stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    pub requests_total: u64,
    /// Prefill: the DP rank that ran the instance. Decode: its own DP rank.
    pub requests_per_rank: Vec<u64>,
    pub ok: u64,
    pub failed: u64,
    /// Ended by `POST /abort_request`.
    pub aborted: u64,
    pub client_disconnects: u64,
    /// Instances in flight now (gauge).
    pub held_now: u64,
    /// Prefill: KV transfers completed (counted on the sending prefill only).
    pub kv_transfers: u64,
    pub contract_violations: u64,
    pub violation_rank_mismatch: u64,
    pub violation_room_reused: u64,
    pub violation_bootstrap_mismatch: u64,
    /// Prefill: a decode of other weights or KV layout (model path, weight version, page
    /// size, KV dtype, speculative settings) asked for a room's KV: on real engines, a
    /// handoff between different models. The transfer is refused.
    #[serde(default)]
    pub violation_kv_layout_mismatch: u64,
    /// `POST /abort_request` calls received, matched or not (a router that aborts legs
    /// which already finished shows here).
    pub abort_requests_received: u64,
    /// Prefill: decodes long-polling this engine's rank endpoints for their KV now (gauge);
    /// lets a test see that a decode reached the rendezvous before its prefill leg.
    #[serde(default)]
    pub kv_waiting_decodes: u64,
    /// Decode: the most request instances that held a running slot at once (admitted
    /// past the engine's queue: KV transfer and generation), over the engine's life and
    /// all its DP ranks; what `max_running_requests` bounds per rank.
    #[serde(default)]
    pub peak_running: u64,
    /// The most request instances present at once (queued or running; `held_now`'s
    /// peak): a router that respects the engine's capacity keeps it at the cap.
    #[serde(default)]
    pub peak_held: u64,
    /// Decode: the same peak per DP rank.
    #[serde(default)]
    pub peak_running_per_rank: Vec<u64>,
    /// Prefill: per DP rank, the prompt tokens of the prompts it computed, each looked up
    /// in the rank's prefix cache (whether it has one or not); empty on a decode.
    #[serde(default)]
    pub prefill_prefix_requested_tokens: Vec<u64>,
    /// Prefill: per DP rank, how many of those its prefix cache held (`cached_tokens`).
    #[serde(default)]
    pub prefill_prefix_cached_tokens: Vec<u64>,
    /// Decode: per DP rank, the prompt tokens of the requests whose KV arrived there.
    #[serde(default)]
    pub decode_prefix_requested_tokens: Vec<u64>,
    /// Decode: per DP rank, how many of those its prefix cache held (no KV wait for them).
    #[serde(default)]
    pub decode_prefix_cached_tokens: Vec<u64>,
    /// Prefill: per DP rank, the most uncached prompt tokens queued for compute at once
    /// (`num_waiting_uncached_tokens`' peak): what a router that bounds a rank's backlog
    /// keeps low. Empty on a decode.
    #[serde(default)]
    pub prefill_peak_waiting_uncached_tokens: Vec<u64>,
}

/// `acc += other`, element-wise (the longer length wins).
fn add_per_rank(acc: &mut Vec<u64>, other: &[u64]) {
    if acc.len() < other.len() {
        acc.resize(other.len(), 0);
    }
    for (a, v) in acc.iter_mut().zip(other) {
        *a += v;
    }
}

/// `cached / requested` summed over ranks; `None` before any lookup.
fn hit_ratio(requested: &[u64], cached: &[u64]) -> Option<f64> {
    let r: u64 = requested.iter().sum();
    let c: u64 = cached.iter().sum();
    (r > 0).then(|| c as f64 / r as f64)
}

impl StatsSnapshot {
    /// The share of prompt tokens the prefill ranks' prefix caches held (`None` before
    /// any prefill).
    pub fn prefill_cache_hit_ratio(&self) -> Option<f64> {
        hit_ratio(
            &self.prefill_prefix_requested_tokens,
            &self.prefill_prefix_cached_tokens,
        )
    }

    /// The share of prompt tokens the decode ranks' prefix caches held (`None` before any
    /// KV arrived).
    pub fn decode_cache_hit_ratio(&self) -> Option<f64> {
        hit_ratio(
            &self.decode_prefix_requested_tokens,
            &self.decode_prefix_cached_tokens,
        )
    }

    /// Adds `other` into `self` (per-rank counters element-wise).
    pub fn add(&mut self, other: &StatsSnapshot) {
        self.requests_total += other.requests_total;
        if self.requests_per_rank.len() < other.requests_per_rank.len() {
            self.requests_per_rank
                .resize(other.requests_per_rank.len(), 0);
        }
        for (acc, v) in self
            .requests_per_rank
            .iter_mut()
            .zip(&other.requests_per_rank)
        {
            *acc += v;
        }
        self.ok += other.ok;
        self.failed += other.failed;
        self.aborted += other.aborted;
        self.client_disconnects += other.client_disconnects;
        self.held_now += other.held_now;
        self.kv_transfers += other.kv_transfers;
        self.contract_violations += other.contract_violations;
        self.violation_rank_mismatch += other.violation_rank_mismatch;
        self.violation_room_reused += other.violation_room_reused;
        self.violation_bootstrap_mismatch += other.violation_bootstrap_mismatch;
        self.violation_kv_layout_mismatch += other.violation_kv_layout_mismatch;
        self.abort_requests_received += other.abort_requests_received;
        self.kv_waiting_decodes += other.kv_waiting_decodes;
        // Peaks of different engines add up to a bound on their joint peak.
        self.peak_running += other.peak_running;
        self.peak_held += other.peak_held;
        if self.peak_running_per_rank.len() < other.peak_running_per_rank.len() {
            self.peak_running_per_rank
                .resize(other.peak_running_per_rank.len(), 0);
        }
        for (acc, v) in self
            .peak_running_per_rank
            .iter_mut()
            .zip(&other.peak_running_per_rank)
        {
            *acc += v;
        }
        add_per_rank(
            &mut self.prefill_prefix_requested_tokens,
            &other.prefill_prefix_requested_tokens,
        );
        add_per_rank(
            &mut self.prefill_prefix_cached_tokens,
            &other.prefill_prefix_cached_tokens,
        );
        add_per_rank(
            &mut self.decode_prefix_requested_tokens,
            &other.decode_prefix_requested_tokens,
        );
        add_per_rank(
            &mut self.decode_prefix_cached_tokens,
            &other.decode_prefix_cached_tokens,
        );
        add_per_rank(
            &mut self.prefill_peak_waiting_uncached_tokens,
            &other.prefill_peak_waiting_uncached_tokens,
        );
    }
}

/// How an instance ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Ok,
    Failed,
    Aborted,
}

/// Which contract rule a violation broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Violation {
    RankMismatch,
    RoomReused,
    BootstrapMismatch,
    KvLayoutMismatch,
}

#[derive(Default)]
struct RankLoad {
    running: AtomicU64,
    waiting: AtomicU64,
    tokens: AtomicU64,
    /// Decode: instances in the pre-allocation queue (arrived, no running slot yet; a
    /// subset of `waiting`).
    prealloc: AtomicU64,
    /// Prefill: instances computed whose KV no decode took yet (SGLang's inflight queue:
    /// neither running nor waiting).
    inflight: AtomicU64,
    /// Prefill: prompt tokens queued for compute that the rank's prefix cache did not
    /// hold when they queued.
    uncached: AtomicU64,
    /// Prefill: the most `uncached` ever held.
    uncached_peak: AtomicU64,
    /// Instances holding a running slot now, and the most at once.
    slots: AtomicU64,
    peak: AtomicU64,
}

/// Live counters of one engine.
pub(crate) struct Stats {
    requests_total: AtomicU64,
    per_rank: Vec<AtomicU64>,
    loads: Vec<RankLoad>,
    ok: AtomicU64,
    failed: AtomicU64,
    aborted: AtomicU64,
    client_disconnects: AtomicU64,
    held_now: AtomicU64,
    kv_transfers: AtomicU64,
    rank_mismatch: AtomicU64,
    room_reused: AtomicU64,
    bootstrap_mismatch: AtomicU64,
    kv_layout_mismatch: AtomicU64,
    pub(crate) abort_requests_received: AtomicU64,
    /// Decodes waiting at this prefill's rank endpoints (see [`StatsSnapshot`]).
    pub(crate) kv_waiting_decodes: AtomicU64,
    /// Mirror of `Faults::down`, read by guards dropped on a cut connection.
    pub(crate) engine_down: AtomicBool,
    /// Instances holding a running slot now (all ranks), and the most at once.
    slots: AtomicU64,
    peak: AtomicU64,
    peak_held: AtomicU64,
    /// Whose lists the prefix counters fill (prefill or decode).
    role: Role,
    /// Per DP rank: prompt tokens looked up in the prefix cache, and those it held.
    prefix_requested: Vec<AtomicU64>,
    prefix_cached: Vec<AtomicU64>,
}

/// Load of one DP rank for `/v1/loads` and `/get_load`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct LoadView {
    pub running: u64,
    /// Queued: a prefill's prompts waiting for compute; a decode's requests before their
    /// first token (pre-allocation queue, KV transfer).
    pub waiting: u64,
    pub tokens: u64,
    /// Decode: of `waiting`, those without a running slot (SGLang's pre-allocation queue).
    pub prealloc: u64,
    /// Prefill: computed, their KV not taken by a decode yet.
    pub inflight: u64,
    /// Prefill: uncached prompt tokens queued for compute.
    pub uncached_tokens: u64,
}

impl Stats {
    pub(crate) fn new(dp: u32, role: Role) -> Arc<Stats> {
        let dp = dp.max(1) as usize;
        let counters = || (0..dp).map(|_| AtomicU64::new(0)).collect::<Vec<_>>();
        Arc::new(Stats {
            requests_total: AtomicU64::new(0),
            per_rank: (0..dp).map(|_| AtomicU64::new(0)).collect(),
            loads: (0..dp).map(|_| RankLoad::default()).collect(),
            ok: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            aborted: AtomicU64::new(0),
            client_disconnects: AtomicU64::new(0),
            held_now: AtomicU64::new(0),
            kv_transfers: AtomicU64::new(0),
            rank_mismatch: AtomicU64::new(0),
            room_reused: AtomicU64::new(0),
            bootstrap_mismatch: AtomicU64::new(0),
            kv_layout_mismatch: AtomicU64::new(0),
            abort_requests_received: AtomicU64::new(0),
            kv_waiting_decodes: AtomicU64::new(0),
            engine_down: AtomicBool::new(false),
            slots: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            peak_held: AtomicU64::new(0),
            role,
            prefix_requested: counters(),
            prefix_cached: counters(),
        })
    }

    /// DP rank `rank` looked up a prompt of `requested` tokens in its prefix cache, which
    /// held `cached` of them (at most `requested` are counted).
    pub(crate) fn prefix_lookup(&self, rank: u32, requested: u32, cached: u32) {
        let r = rank as usize;
        if let (Some(req), Some(hit)) = (self.prefix_requested.get(r), self.prefix_cached.get(r)) {
            req.fetch_add(u64::from(requested), Ordering::Relaxed);
            hit.fetch_add(u64::from(cached.min(requested)), Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        let rank_mismatch = self.rank_mismatch.load(Ordering::Relaxed);
        let room_reused = self.room_reused.load(Ordering::Relaxed);
        let bootstrap_mismatch = self.bootstrap_mismatch.load(Ordering::Relaxed);
        let kv_layout_mismatch = self.kv_layout_mismatch.load(Ordering::Relaxed);
        let load = |v: &[AtomicU64]| v.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let (requested, cached) = (load(&self.prefix_requested), load(&self.prefix_cached));
        let ((prefill_requested, prefill_cached), (decode_requested, decode_cached)) =
            match self.role {
                Role::Prefill => ((requested, cached), Default::default()),
                Role::Decode => (Default::default(), (requested, cached)),
                Role::Regular => Default::default(),
            };
        StatsSnapshot {
            requests_total: self.requests_total.load(Ordering::Relaxed),
            requests_per_rank: self
                .per_rank
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            ok: self.ok.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            aborted: self.aborted.load(Ordering::Relaxed),
            client_disconnects: self.client_disconnects.load(Ordering::Relaxed),
            held_now: self.held_now.load(Ordering::Relaxed),
            kv_transfers: self.kv_transfers.load(Ordering::Relaxed),
            contract_violations: rank_mismatch
                + room_reused
                + bootstrap_mismatch
                + kv_layout_mismatch,
            violation_rank_mismatch: rank_mismatch,
            violation_room_reused: room_reused,
            abort_requests_received: self.abort_requests_received.load(Ordering::Relaxed),
            violation_bootstrap_mismatch: bootstrap_mismatch,
            violation_kv_layout_mismatch: kv_layout_mismatch,
            kv_waiting_decodes: self.kv_waiting_decodes.load(Ordering::Relaxed),
            peak_running: self.peak.load(Ordering::Relaxed),
            peak_held: self.peak_held.load(Ordering::Relaxed),
            peak_running_per_rank: self
                .loads
                .iter()
                .map(|l| l.peak.load(Ordering::Relaxed))
                .collect(),
            prefill_prefix_requested_tokens: prefill_requested,
            prefill_prefix_cached_tokens: prefill_cached,
            decode_prefix_requested_tokens: decode_requested,
            decode_prefix_cached_tokens: decode_cached,
            prefill_peak_waiting_uncached_tokens: match self.role {
                Role::Prefill => self
                    .loads
                    .iter()
                    .map(|l| l.uncached_peak.load(Ordering::Relaxed))
                    .collect(),
                Role::Decode | Role::Regular => Vec::new(),
            },
        }
    }

    pub(crate) fn loads(&self) -> Vec<LoadView> {
        self.loads
            .iter()
            .map(|l| LoadView {
                running: l.running.load(Ordering::Relaxed),
                waiting: l.waiting.load(Ordering::Relaxed),
                tokens: l.tokens.load(Ordering::Relaxed),
                prealloc: l.prealloc.load(Ordering::Relaxed),
                inflight: l.inflight.load(Ordering::Relaxed),
                uncached_tokens: l.uncached.load(Ordering::Relaxed),
            })
            .collect()
    }

    pub(crate) fn violation(&self, v: Violation) {
        let counter = match v {
            Violation::RankMismatch => &self.rank_mismatch,
            Violation::RoomReused => &self.room_reused,
            Violation::BootstrapMismatch => &self.bootstrap_mismatch,
            Violation::KvLayoutMismatch => &self.kv_layout_mismatch,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(violation = ?v, "sim: PD contract violation");
    }

    pub(crate) fn kv_transfer(&self) {
        self.kv_transfers.fetch_add(1, Ordering::Relaxed);
    }

    /// Starts tracking one request instance.
    pub(crate) fn begin(self: &Arc<Self>) -> InstanceGuard {
        self.requests_total.fetch_add(1, Ordering::Relaxed);
        let held = self.held_now.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak_held.fetch_max(held, Ordering::AcqRel);
        InstanceGuard {
            stats: Arc::clone(self),
            outcome: None,
            rank: None,
            phase: Phase::None,
            tokens: 0,
            slot: None,
            prealloc: false,
            queued_uncached: 0,
        }
    }

    fn record(&self, outcome: Option<Outcome>) {
        let counter = match outcome {
            Some(Outcome::Ok) => &self.ok,
            Some(Outcome::Failed) => &self.failed,
            Some(Outcome::Aborted) => &self.aborted,
            None if self.engine_down.load(Ordering::Relaxed) => &self.failed,
            None => &self.client_disconnects,
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    None,
    Waiting,
    Running,
    /// Prefill: computed, waiting for its decode to take the KV.
    Inflight,
}

/// Tracks one request instance from start to outcome; see the module invariants.
pub(crate) struct InstanceGuard {
    stats: Arc<Stats>,
    outcome: Option<Outcome>,
    rank: Option<usize>,
    phase: Phase,
    tokens: u64,
    /// The running slot the instance holds (decode), and whether it counts in `slots`.
    slot: Option<Option<tokio::sync::OwnedSemaphorePermit>>,
    /// Decode: counted in its rank's pre-allocation queue (until it holds a slot).
    prealloc: bool,
    /// Prefill: uncached prompt tokens it counts in its rank's queue (until its compute
    /// starts).
    queued_uncached: u64,
}

impl InstanceGuard {
    /// The instance holds a running slot (`permit` when the engine caps its ranks) until
    /// it ends; counted in the peaks. Needs the rank set first.
    pub(crate) fn hold_slot(&mut self, permit: Option<tokio::sync::OwnedSemaphorePermit>) {
        if self.slot.is_some() {
            return;
        }
        self.leave_prealloc();
        let now = self.stats.slots.fetch_add(1, Ordering::AcqRel) + 1;
        self.stats.peak.fetch_max(now, Ordering::AcqRel);
        if let Some(l) = self.load() {
            let now = l.slots.fetch_add(1, Ordering::AcqRel) + 1;
            l.peak.fetch_max(now, Ordering::AcqRel);
        }
        self.slot = Some(permit);
    }

    /// Records the DP rank that handles the instance (once).
    pub(crate) fn set_rank(&mut self, rank: u32) {
        if self.rank.is_some() {
            return;
        }
        let r = rank as usize;
        if let Some(c) = self.stats.per_rank.get(r) {
            c.fetch_add(1, Ordering::Relaxed);
            self.rank = Some(r);
        }
    }

    fn load(&self) -> Option<&RankLoad> {
        self.rank.and_then(|r| self.stats.loads.get(r))
    }

    fn leave_phase(&mut self) {
        if let Some(l) = self.load() {
            match self.phase {
                Phase::Waiting => {
                    l.waiting.fetch_sub(1, Ordering::Relaxed);
                }
                Phase::Running => {
                    l.running.fetch_sub(1, Ordering::Relaxed);
                }
                Phase::Inflight => {
                    l.inflight.fetch_sub(1, Ordering::Relaxed);
                }
                Phase::None => {}
            }
        }
        self.phase = Phase::None;
    }

    /// The instance waits (bootstrap / transfer queue).
    pub(crate) fn waiting(&mut self) {
        self.leave_phase();
        if let Some(l) = self.load() {
            l.waiting.fetch_add(1, Ordering::Relaxed);
            self.phase = Phase::Waiting;
        }
    }

    /// The instance runs (prefill compute / decode generation).
    pub(crate) fn running(&mut self) {
        self.leave_phase();
        if let Some(l) = self.load() {
            l.running.fetch_add(1, Ordering::Relaxed);
            self.phase = Phase::Running;
        }
    }

    /// The instance (a prefill's, computed) waits for its decode to take the KV.
    pub(crate) fn inflight(&mut self) {
        self.leave_phase();
        if let Some(l) = self.load() {
            l.inflight.fetch_add(1, Ordering::Relaxed);
            self.phase = Phase::Inflight;
        }
    }

    /// The instance (a decode's) joins its rank's pre-allocation queue, which it leaves
    /// when it holds a running slot ([`Self::hold_slot`]). Needs the rank set first.
    pub(crate) fn prealloc(&mut self) {
        if self.prealloc || self.slot.is_some() {
            return;
        }
        if let Some(l) = self.load() {
            l.prealloc.fetch_add(1, Ordering::Relaxed);
            self.prealloc = true;
        }
    }

    fn leave_prealloc(&mut self) {
        if std::mem::take(&mut self.prealloc) {
            if let Some(l) = self.load() {
                l.prealloc.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    /// The instance (a prefill's) waits for its compute with `n` prompt tokens its rank's
    /// cache lacks, until [`Self::compute_starts`]. Needs the rank set first.
    pub(crate) fn queue_uncached(&mut self, n: u64) {
        self.compute_starts();
        if let Some(l) = self.load() {
            let now = l.uncached.fetch_add(n, Ordering::Relaxed).saturating_add(n);
            l.uncached_peak.fetch_max(now, Ordering::Relaxed);
            self.queued_uncached = n;
        }
    }

    /// The instance's compute starts: its tokens leave the rank's queue.
    pub(crate) fn compute_starts(&mut self) {
        let n = std::mem::take(&mut self.queued_uncached);
        if n > 0 {
            if let Some(l) = self.load() {
                l.uncached.fetch_sub(n, Ordering::Relaxed);
            }
        }
    }

    /// Adds KV tokens held by the instance.
    pub(crate) fn add_tokens(&mut self, n: u64) {
        if let Some(l) = self.load() {
            l.tokens.fetch_add(n, Ordering::Relaxed);
            self.tokens += n;
        }
    }

    /// Sets the outcome; the last call wins, the record happens on drop.
    pub(crate) fn finish(&mut self, outcome: Outcome) {
        self.outcome = Some(outcome);
    }
}

impl Drop for InstanceGuard {
    fn drop(&mut self) {
        self.leave_prealloc();
        self.compute_starts();
        if self.slot.take().is_some() {
            self.stats.slots.fetch_sub(1, Ordering::AcqRel);
            if let Some(l) = self.load() {
                l.slots.fetch_sub(1, Ordering::AcqRel);
            }
        }
        self.leave_phase();
        if let Some(l) = self.load() {
            l.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        }
        self.stats.record(self.outcome);
        self.stats.held_now.fetch_sub(1, Ordering::Relaxed);
    }
}

/// An [`InstanceGuard`] usable through `&self` from concurrent futures.
pub(crate) struct Tracker(std::sync::Mutex<InstanceGuard>);

impl Tracker {
    pub(crate) fn new(guard: InstanceGuard) -> Self {
        Tracker(std::sync::Mutex::new(guard))
    }

    fn with<R>(&self, f: impl FnOnce(&mut InstanceGuard) -> R) -> R {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g)
    }

    pub(crate) fn set_rank(&self, rank: u32) {
        self.with(|g| g.set_rank(rank));
    }

    pub(crate) fn waiting(&self) {
        self.with(InstanceGuard::waiting);
    }

    pub(crate) fn running(&self) {
        self.with(InstanceGuard::running);
    }

    pub(crate) fn add_tokens(&self, n: u64) {
        self.with(|g| g.add_tokens(n));
    }

    pub(crate) fn finish(&self, outcome: Outcome) {
        self.with(|g| g.finish(outcome));
    }

    pub(crate) fn hold_slot(&self, permit: Option<tokio::sync::OwnedSemaphorePermit>) {
        self.with(|g| g.hold_slot(permit));
    }

    pub(crate) fn inflight(&self) {
        self.with(InstanceGuard::inflight);
    }

    pub(crate) fn prealloc(&self) {
        self.with(InstanceGuard::prealloc);
    }

    pub(crate) fn queue_uncached(&self, n: u64) {
        self.with(|g| g.queue_uncached(n));
    }

    pub(crate) fn compute_starts(&self) {
        self.with(InstanceGuard::compute_starts);
    }
}
