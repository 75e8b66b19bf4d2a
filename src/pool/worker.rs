//! One worker, as the pool's master list keeps it ([`Worker`]) and as a snapshot shows it
//! ([`WorkerView`]): both are made of the same three parts, so a snapshot rebuild clones
//! two `Arc`s and the facts rather than copying handles one by one.
//!
//! - [`WorkerShared`]: who the worker is and the handles that live as long as it does
//!   (breaker, connections, stats, the bootstrap re-read signal, the loss channel, the
//!   stop token). Built once when the worker joins the pool and never changed after: the
//!   master entry and every snapshot's view hold the same `Arc`.
//! - [`RankHandles`]: the handles sized to the worker's DP size (in-flight counters,
//!   engine load, capacity, prefill backlog, rank probes, learned progress, rank
//!   freshness, the cache tally). What they
//!   point to (atomics, mostly) is written in place by whoever owns it (see
//!   ARCHITECTURE.md, "Who writes shared state"); the set itself is replaced whole, by the
//!   pool's writer only, when the DP size changes ([`super::Pool::update_worker_if`]). A
//!   view keeps the set its snapshot was built with, so a request in flight keeps
//!   counting on the ranks it was planned on.
//! - [`WorkerFacts`]: what the pool's single writer has learned or been told about the
//!   worker (health, layout, rank readiness, server info, refusals, drain reasons, the
//!   operator's model name). Written only through the pool's writers
//!   ([`super::Pool::update_worker`] and friends), under its mutex; a view holds a copy as
//!   of its snapshot.
//!
//! A view adds only what its snapshot derives from all workers together (its handoff
//! group, its effective model) and its own receiver of the loss channel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::{
    capacity, Breaker, Drain, RankCapacity, RankFreshness, RankProbes, RankReadiness, WorkerSource,
    WorkerStats,
};
use crate::engine::{Layout, ServerInfo};
use crate::progress::WorkerProgress;
use crate::types::{DpRank, Role, WorkerId};
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

/// Who a worker is and the handles that live as long as it does in the pool.
///
/// Immutable once built (when the worker joins): no field is ever reassigned, and the
/// master entry and every view share one `Arc` of it. The handles are `Arc`s where a
/// task or a leg keeps one past the snapshot it came from; what they point to is written
/// in place (atomics, locks, channels) by its owner.
#[derive(Debug)]
pub struct WorkerShared {
    /// Never reused within its role.
    pub id: WorkerId,
    pub role: Role,
    pub url: BaseUrl,
    /// Who added it, and so who may change or remove it.
    pub source: WorkerSource,
    /// Cancelled when the worker leaves the pool (by [`super::Pool::remove_worker`] only):
    /// ends its background tasks.
    pub stop: CancellationToken,
    /// Wakes the prefill's bootstrap tracker for a re-read of its rank routes (a signal:
    /// a failed leg or preflight, a restart, a layout change). Coalesced.
    pub refresh: Arc<Notify>,
    /// Bumped by the bootstrap tracker when the prefill (or one of its ranks) is lost;
    /// in-flight requests on it whose prefill has not answered yet watch a receiver
    /// ([`WorkerView::lost`]).
    pub lost_tx: watch::Sender<LostEpochs>,
    /// Passive health of this worker's legs.
    pub breaker: Arc<Breaker>,
    /// Kept-alive connections for this worker's legs.
    pub conns: Arc<HostConns>,
    /// Leg outcomes and times, for `/metrics` ([`super::stats`]).
    pub stats: Arc<WorkerStats>,
}

/// The handles a worker has per DP rank, all of one length (its DP size, at least 1).
///
/// Replaced whole by the pool's writer when the DP size changes, never otherwise; the
/// counters inside are written in place.
#[derive(Debug)]
pub struct RankHandles {
    /// Requests pdgate has in flight per rank (held by [`super::LoadGuard`]s).
    pub loads: Arc<[AtomicU64]>,
    /// Engine-reported load per rank (requests running + waiting, from `/v1/loads` or
    /// `/get_load`); all 0 while not polled. Written by the load poller.
    pub engine_load: Arc<[AtomicU64]>,
    /// Capacity per rank (decode): the engine's figures, written by the load poller and
    /// the health checker, and this replica's reservations ([`super::capacity`]).
    pub capacity: Arc<[RankCapacity]>,
    /// Prefill backlog per rank: the engine's queued uncached tokens (written by the load
    /// poller), this replica's legs in flight, the learned pace ([`super::backlog`]).
    pub backlog: Arc<[super::backlog::RankBacklog]>,
    /// Request-path rank checks in flight (prefill only).
    pub probes: Arc<RankProbes>,
    /// Learned leg times and progress (stall detection).
    pub progress: Arc<WorkerProgress>,
    /// When each rank was last confirmed (atomics: no rebuild per confirmation).
    pub fresh: Arc<RankFreshness>,
    /// What each rank's prefix cache did for its requests, and affinity spills into it.
    pub tally: Arc<super::tally::RankTally>,
}

impl RankHandles {
    /// Fresh handles for `dp` ranks (at least one): nothing in flight, nothing learned.
    pub fn new(dp: u32) -> RankHandles {
        let dp = dp.max(1);
        let counters = || (0..dp).map(|_| AtomicU64::new(0)).collect();
        RankHandles {
            loads: counters(),
            engine_load: counters(),
            capacity: capacity::new_ranks(dp),
            backlog: super::backlog::new_ranks(dp),
            probes: Arc::new(RankProbes::new(dp)),
            progress: Arc::new(WorkerProgress::new(dp)),
            fresh: Arc::new(RankFreshness::new(dp)),
            tally: Arc::new(super::tally::RankTally::new(dp)),
        }
    }
}

/// What the pool's writer has learned or been told about a worker. Written only under the
/// pool's writer lock; a snapshot's view holds a copy (cheap: the large parts are `Arc`s).
#[derive(Clone, Debug, Default)]
pub struct WorkerFacts {
    /// The engine answers its health check.
    pub healthy: bool,
    /// The health checker has run at least once.
    pub health_checked: bool,
    /// The DP size `/server_info` reports.
    pub dp_size: Option<u32>,
    /// Prefill only.
    pub bootstrap: Option<BootstrapInfo>,
    /// The prefill's bootstrap layout, once read.
    pub layout: Option<Layout>,
    /// Readiness per DP rank (prefill: from its bootstrap server).
    pub ranks: Vec<RankReadiness>,
    /// The engine's `/server_info` facts, once read.
    pub info: Option<Arc<ServerInfo>>,
    /// The model clients name for this worker, set by the operator (config, admin API):
    /// wins over what the engine reports.
    pub model_override: Option<Arc<str>>,
    /// Why the worker can never take a leg (e.g. a DP size above the limit); never
    /// routable while set.
    pub refused: Option<String>,
    /// Why the prefill's bootstrap server is not its own (`crate::bootstrap::ownership`);
    /// kept apart from `refused`, which the health checker sets and clears from
    /// `/server_info` alone. Never routable while set.
    pub bootstrap_refused: Option<String>,
    /// Takes no new request while any reason holds; requests in flight finish.
    pub drain: Drain,
}

impl WorkerFacts {
    /// The DP size legs are planned with (and the per-rank handles are sized to): the
    /// prefill's bootstrap layout, the decode's server info, else 1.
    pub fn effective_dp(&self) -> u32 {
        match (&self.layout, self.dp_size) {
            (Some(l), _) => l.dp_size.max(1),
            (None, Some(d)) => d.max(1),
            (None, None) => 1,
        }
    }

    /// Out of rotation for one of [`Drain`]'s reasons.
    pub fn draining(&self) -> bool {
        self.drain.any()
    }

    /// Being removed (drains, then leaves the pool).
    pub fn leaving(&self) -> bool {
        self.drain.leaving
    }

    /// Why the worker can never take a leg, either reason (`refused` first).
    pub fn refusal(&self) -> Option<&str> {
        self.refused
            .as_deref()
            .or(self.bootstrap_refused.as_deref())
    }

    /// The engine streams `/generate` incrementally (`/server_info`
    /// `incremental_streaming_output`), not SGLang's default cumulative text.
    pub fn incremental_stream(&self) -> bool {
        self.info
            .as_ref()
            .and_then(|i| i.incremental_streaming_output)
            .unwrap_or(false)
    }
}

/// One worker in the pool's master list, owned by the pool's single writer.
///
/// A writer's closure ([`super::Pool::update_worker`]) gets `&mut Worker` but can change
/// only `facts`: the two handle sets are private to the pool (the shared part reads
/// through [`Worker::shared`]; the per-rank handles through a snapshot's view).
#[derive(Debug)]
pub struct Worker {
    /// Identity and life-long handles (never changed).
    pub(super) shared: Arc<WorkerShared>,
    /// Per-rank handles (replaced by the pool when the DP size changes).
    pub(super) per_rank: Arc<RankHandles>,
    /// What the writer knows.
    pub facts: WorkerFacts,
}

impl Worker {
    /// A worker joining the pool as `id`: unchecked, one rank, nothing learned.
    pub(super) fn new(
        id: WorkerId,
        role: Role,
        url: BaseUrl,
        bootstrap: Option<BootstrapInfo>,
        source: WorkerSource,
    ) -> Worker {
        let (lost_tx, _) = watch::channel(LostEpochs::default());
        Worker {
            shared: Arc::new(WorkerShared {
                id,
                role,
                conns: Arc::new(HostConns::new(&url)),
                url,
                source,
                stop: CancellationToken::new(),
                refresh: Arc::new(Notify::new()),
                lost_tx,
                breaker: Arc::new(Breaker::default()),
                stats: Arc::default(),
            }),
            per_rank: Arc::new(RankHandles::new(1)),
            facts: WorkerFacts {
                bootstrap,
                ..WorkerFacts::default()
            },
        }
    }

    /// Who the worker is, and its life-long handles.
    pub fn shared(&self) -> &Arc<WorkerShared> {
        &self.shared
    }

    /// Whether this is worker `id` of `role`.
    pub(super) fn is(&self, role: Role, id: WorkerId) -> bool {
        self.shared.role == role && self.shared.id == id
    }
}

/// One worker as a snapshot shows it: the master entry's shared part and per-rank handles
/// (the same `Arc`s), a copy of its facts, and what the snapshot derived.
#[derive(Debug)]
pub struct WorkerView {
    pub shared: Arc<WorkerShared>,
    pub per_rank: Arc<RankHandles>,
    /// The facts as of this snapshot.
    pub facts: WorkerFacts,
    /// Its handoff group (index into `Snapshot::groups`): it pairs only within it.
    pub group: usize,
    /// The model it serves, when known (override, else what the engine reports).
    pub model: Option<Arc<str>>,
    /// Loss signals of the prefill ([`WorkerShared::lost_tx`]), subscribed when the
    /// snapshot was built.
    pub lost: watch::Receiver<LostEpochs>,
}

impl WorkerView {
    /// The DP size legs are planned with ([`WorkerFacts::effective_dp`]).
    pub fn effective_dp(&self) -> u32 {
        self.facts.effective_dp()
    }

    /// Requests pdgate has in flight on the worker, all ranks together.
    pub fn in_flight_total(&self) -> u64 {
        self.per_rank
            .loads
            .iter()
            .fold(0u64, |a, c| a.saturating_add(c.load(Ordering::Relaxed)))
    }

    /// Requests pdgate has in flight on `rank`.
    pub fn in_flight(&self, rank: DpRank) -> u64 {
        self.per_rank
            .loads
            .get(rank as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The engine's own last reported load on `rank` (0 when not polled).
    pub fn engine_load(&self, rank: DpRank) -> u64 {
        self.per_rank
            .engine_load
            .get(rank as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// The capacity state of `rank`.
    pub fn capacity(&self, rank: DpRank) -> Option<&RankCapacity> {
        self.per_rank.capacity.get(rank as usize)
    }
}
