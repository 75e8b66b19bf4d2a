//! The shared state of one simulated engine ([`Engine`]): its configuration, faults,
//! stats, listeners' addresses, the prefill side (bootstrap table, KV rendezvous), the
//! decode side's caches, and the rids in flight and seen.
//!
//! Why a module of its own: every request handler (prefill, decode, run, info) reads it,
//! and [`crate::engine`] (which starts the listeners and routes requests to those
//! handlers) builds it; keeping the state apart from the routing keeps the module graph
//! acyclic.
//!
//! Invariants:
//! - The current [`Faults`] live in one `watch` channel; `Stats::engine_down`
//!   mirrors `faults.down` (set together in [`Engine::set_faults`] and
//!   [`Engine::set_down`]).
//! - A [`RidLog`] keeps at most [`RECENT_RIDS`] rids; an [`Inflight`] entry lives exactly
//!   as long as its [`Registration`].

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::{oneshot, watch};

use crate::bootstrap::BootstrapState;
use crate::config::{EngineConfig, Faults};
use crate::contract::SeenRooms;
use crate::decode_cache::DecodeState;
use crate::rendezvous::Rendezvous;
use crate::stats::Stats;

/// Prefill-only parts of an engine.
pub(crate) struct PrefillSide {
    pub bootstrap: Arc<BootstrapState>,
    pub rendezvous: Arc<Rendezvous>,
    pub seen: Mutex<SeenRooms>,
    pub rank_ports: Vec<u16>,
}

/// Shared state of one engine.
pub(crate) struct Engine {
    pub cfg: EngineConfig,
    pub faults_tx: watch::Sender<Faults>,
    pub shutdown_tx: watch::Sender<bool>,
    pub stats: Arc<Stats>,
    pub addr: SocketAddr,
    pub bootstrap_port: Option<u16>,
    pub inflight: Arc<Inflight>,
    pub rr: AtomicU64,
    pub prefill: Option<PrefillSide>,
    pub decode: DecodeState,
    /// The headers of the last generate request (names in lower case), for tests of what
    /// a router forwards.
    pub last_headers: std::sync::Mutex<Vec<(String, String)>>,
    /// The rids of the request instances that started ([`crate::SimEngine::recent_rids`]).
    pub started_rids: RidLog,
    /// When the prompt compute in progress ends: a plain engine, or a prefill with
    /// `serial_prefill` (`Engine::queue_compute`).
    pub busy_until: Mutex<Option<tokio::time::Instant>>,
    /// The bodies of the last [`RECENT_RIDS`] generate requests, as received.
    pub bodies: Mutex<VecDeque<(String, serde_json::Value)>>,
    /// The rids named by `POST /abort_request` ([`crate::SimEngine::recent_abort_rids`]).
    pub abort_rids: RidLog,
    /// Decode with `max_running_requests`: one semaphore of that many running slots per
    /// DP rank (empty: no limit).
    pub running_slots: Vec<Arc<tokio::sync::Semaphore>>,
    /// Requests per server and path ([`crate::SimEngine::hits`]).
    pub hits: crate::hits::Hits,
    /// One prefix cache per DP rank when the engine's role has one
    /// (`EngineConfig::prefix_cache_tokens`), else empty. Locked only for a lookup or an
    /// insert, never across an await.
    pub prefix_caches: Vec<std::sync::Mutex<crate::prefix_cache::PrefixCache>>,
    /// A prefill with prefix caches: one lock per DP rank, held for the whole prompt
    /// compute (one prompt at a time per rank; the queue for it is what `/v1/loads`
    /// reports as `num_waiting_uncached_tokens`); else empty.
    pub compute_locks: Vec<tokio::sync::Mutex<()>>,
}

/// How many rids a [`RidLog`] keeps (bounded: benches run long).
pub const RECENT_RIDS: usize = 1024;

/// The last [`RECENT_RIDS`] rids of one kind of event, oldest first. Tests follow one
/// client request across engines with them: a router gives each attempt of a leg its own
/// rid.
#[derive(Default)]
pub(crate) struct RidLog(Mutex<VecDeque<String>>);

impl RidLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<String>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn push(&self, rid: &str) {
        let mut g = self.lock();
        if g.len() == RECENT_RIDS {
            g.pop_front();
        }
        g.push_back(rid.to_string());
    }

    pub(crate) fn list(&self) -> Vec<String> {
        self.lock().iter().cloned().collect()
    }
}

impl Engine {
    /// Rank `rank`'s prefix cache, locked (a poisoned lock is taken over: the cache holds
    /// no invariant a panic elsewhere could break).
    pub(crate) fn prefix_cache(
        &self,
        rank: u32,
    ) -> Option<std::sync::MutexGuard<'_, crate::prefix_cache::PrefixCache>> {
        self.prefix_caches
            .get(rank as usize)
            .map(|c| c.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Queues a prompt compute of `compute` on the engine (a plain engine, or a prefill
    /// with `serial_prefill`): it ends `compute` after the last queued one ends, or from
    /// now. Returns when it ends.
    pub(crate) fn queue_compute(&self, compute: std::time::Duration) -> tokio::time::Instant {
        let mut busy = self.busy_until.lock().unwrap_or_else(|e| e.into_inner());
        let now = tokio::time::Instant::now();
        let start = busy.map_or(now, |b| b.max(now));
        let until = start + compute;
        *busy = Some(until);
        until
    }

    pub(crate) fn faults(&self) -> Faults {
        self.faults_tx.borrow().clone()
    }

    pub(crate) fn set_faults(&self, f: Faults) {
        self.stats.engine_down.store(f.down, Ordering::Relaxed);
        self.faults_tx.send_replace(f);
    }

    pub(crate) fn set_down(&self, down: bool) {
        self.stats.engine_down.store(down, Ordering::Relaxed);
        self.faults_tx.send_modify(|f| f.down = down);
    }

    /// The IP other processes should use to reach this engine's listeners.
    pub(crate) fn public_ip(&self) -> String {
        let ip = self.addr.ip();
        if ip.is_unspecified() {
            "127.0.0.1".to_string()
        } else {
            ip.to_string()
        }
    }

    /// Next round-robin DP rank.
    pub(crate) fn next_rr(&self) -> u32 {
        (self.rr.fetch_add(1, Ordering::Relaxed) % u64::from(self.cfg.dp())) as u32
    }
}

/// In-flight instances by rid, for `POST /abort_request`.
#[derive(Default)]
pub(crate) struct Inflight {
    map: Mutex<HashMap<u64, (String, oneshot::Sender<()>)>>,
    next: AtomicU64,
}

/// Removes its rid from [`Inflight`] when dropped.
pub(crate) struct Registration {
    inflight: Arc<Inflight>,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.inflight.lock().remove(&self.id);
    }
}

impl Inflight {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (String, oneshot::Sender<()>)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn register(self: &Arc<Self>, rid: &str) -> (oneshot::Receiver<()>, Registration) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.lock().insert(id, (rid.to_string(), tx));
        (
            rx,
            Registration {
                inflight: Arc::clone(self),
                id,
            },
        )
    }

    /// SGLang semantics: the tokenizer ignores an untracked rid (unless
    /// `abort_all`); the scheduler then aborts every rid starting with it.
    pub(crate) fn abort(&self, rid: &str, all: bool) -> usize {
        let mut g = self.lock();
        if !all && !g.values().any(|(r, _)| r == rid) {
            return 0;
        }
        let ids: Vec<u64> = g
            .iter()
            .filter(|(_, (r, _))| all || r.starts_with(rid))
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            if let Some((_, tx)) = g.remove(id) {
                let _ = tx.send(());
            }
        }
        ids.len()
    }
}
