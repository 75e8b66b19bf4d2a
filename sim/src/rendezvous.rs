//! The KV rendezvous between a prefill request and its decode, on the prefill
//! engine: one room table per engine, and the rank endpoints (one TCP listener
//! per DP rank, the stand-in for SGLang's ZMQ channel) that decodes long-poll.
//!
//! Protocol (rank endpoint): `POST /kv/{room}` with JSON
//! `{bootstrap_host, bootstrap_port, bootstrap_room, decode_rid}`; the answer
//! comes when the room's prefill on *this* rank finished its transfer
//! (`{"status":"success","cached_tokens":N}`, N the prompt tokens the prefill's prefix
//! cache held, which SGLang's decode reports as its own `cached_tokens`) or failed / was
//! aborted (`{"status":"failed","reason":…}`). `GET /health` answers `OK`.
//!
//! Invariants:
//! - A decode whose `kv_identity` (weights, version, KV layout) differs from the
//!   prefill's is refused at once and counted (a cross-model handoff).
//! - Either leg may arrive first; a transfer completes only when the prefill
//!   leg and the decode leg of a room are on the same rank.
//! - A decode waiting on rank k for a room the prefill runs on rank j ≠ k is a
//!   rank-mismatch violation, counted once per room when the second leg
//!   arrives; both legs keep waiting until their own timeouts (as real engines).
//! - A leg leaves the table when its future is dropped (guards): a prefill
//!   leaving early fails the waiting decode of the same rank ("Failed to get
//!   kvcache…"), a decode leaving early fails the waiting prefill (SGLang's
//!   decode → prefill ABORT).
//! - A second live decode for the same room is refused (`DeferredBootstrap`).
//! - An engine that is down notifies nobody: its rank connections are cut and
//!   the decode learns of the death from its heartbeat, as with a real crash.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use hyper::body::Incoming;
use hyper::{Method, Request};
use serde_json::{json, Value};
use tokio::sync::{oneshot, Notify};

use crate::contract::{BookEntry, ContractBook, LegKind};
use crate::http::{self, Cut, Resp};
use crate::stats::{Stats, Violation};

/// How a decode's wait ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KvOutcome {
    /// The KV arrived; the prefill's cached tokens of the prompt.
    Success {
        cached_tokens: u32,
    },
    Failed(String),
}

/// SGLang's reason when the prefill side failed.
pub(crate) const PREFILL_DEAD: &str =
    "Failed to get kvcache from prefill instance, it might be dead";

struct PrefillLeg {
    id: u64,
    rank: u32,
    notify: Arc<Notify>,
    failed: Option<String>,
}

struct DecodeLeg {
    id: u64,
    rank: u32,
    done: Option<oneshot::Sender<KvOutcome>>,
}

#[derive(Default)]
struct Slot {
    prefill: Option<PrefillLeg>,
    decode: Option<DecodeLeg>,
    rank_mismatch_counted: bool,
}

/// Room table of one prefill engine.
pub(crate) struct Rendezvous {
    slots: Mutex<HashMap<u64, Slot>>,
    stats: Arc<Stats>,
    book: Arc<ContractBook>,
    next_id: AtomicU64,
    /// This prefill's [`crate::config::EngineConfig::kv_identity`].
    kv_identity: String,
}

impl Rendezvous {
    pub(crate) fn new(
        stats: Arc<Stats>,
        book: Arc<ContractBook>,
        kv_identity: String,
    ) -> Arc<Self> {
        Arc::new(Rendezvous {
            slots: Mutex::new(HashMap::new()),
            stats,
            book,
            next_id: AtomicU64::new(1),
            kv_identity,
        })
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_rank(&self, slot: &mut Slot) {
        if let (Some(p), Some(d)) = (&slot.prefill, &slot.decode) {
            if p.rank != d.rank && !slot.rank_mismatch_counted {
                slot.rank_mismatch_counted = true;
                self.stats.violation(Violation::RankMismatch);
            }
        }
    }

    /// A prefill request for `room` runs on `rank`: enter its leg.
    pub(crate) fn prefill_arrive(
        self: &Arc<Self>,
        room: u64,
        rank: u32,
        host: Option<String>,
        port: Option<u16>,
    ) -> PrefillHandle {
        let (entry, mismatch) = self.book.enter(room, LegKind::Prefill, host, port);
        if mismatch {
            self.stats.violation(Violation::BootstrapMismatch);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let notify = Arc::new(Notify::new());
        let mut g = self.lock();
        let slot = g.entry(room).or_default();
        if let Some(old) = slot.prefill.replace(PrefillLeg {
            id,
            rank,
            notify,
            failed: None,
        }) {
            // The older request with this room is superseded; wake it to fail.
            old.notify.notify_one();
        }
        self.check_rank(slot);
        PrefillHandle {
            rv: Arc::clone(self),
            room,
            id,
            done: false,
            _entry: entry,
        }
    }

    /// A decode waits on `rank` for `room`'s KV.
    pub(crate) async fn decode_wait(
        self: &Arc<Self>,
        room: u64,
        rank: u32,
        host: Option<String>,
        port: Option<u16>,
    ) -> KvOutcome {
        let (entry, mismatch) = self.book.enter(room, LegKind::Decode, host, port);
        if mismatch {
            self.stats.violation(Violation::BootstrapMismatch);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut g = self.lock();
            let slot = g.entry(room).or_default();
            if let Some(d) = &slot.decode {
                if d.done.as_ref().is_some_and(|s| !s.is_closed()) {
                    return KvOutcome::Failed(format!(
                        "bootstrap_room {room} already has a decode receiver"
                    ));
                }
            }
            slot.decode = Some(DecodeLeg {
                id,
                rank,
                done: Some(tx),
            });
            self.check_rank(slot);
            if let Some(p) = &slot.prefill {
                if p.rank == rank {
                    p.notify.notify_one();
                }
            }
        }
        self.stats
            .kv_waiting_decodes
            .fetch_add(1, Ordering::Relaxed);
        let _guard = DecodeGuard {
            rv: Arc::clone(self),
            room,
            id,
            _entry: entry,
        };
        rx.await
            .unwrap_or_else(|_| KvOutcome::Failed(PREFILL_DEAD.to_string()))
    }

    fn remove_empty(g: &mut HashMap<u64, Slot>, room: u64) {
        if g.get(&room)
            .is_some_and(|s| s.prefill.is_none() && s.decode.is_none())
        {
            g.remove(&room);
        }
    }
}

/// The prefill leg of a room; dropping it before success fails its decode.
pub(crate) struct PrefillHandle {
    rv: Arc<Rendezvous>,
    room: u64,
    id: u64,
    done: bool,
    _entry: BookEntry,
}

impl PrefillHandle {
    /// Waits (up to `timeout`) for the decode on the same rank, then completes
    /// the transfer, telling it the prompt's `cached_tokens` on this prefill. `Err`
    /// carries SGLang's failure reason.
    pub(crate) async fn transfer(
        &mut self,
        timeout: Duration,
        cached_tokens: u32,
    ) -> Result<(), String> {
        let deadline = http::deadline(tokio::time::Instant::now(), timeout);
        loop {
            let notify = {
                let mut g = self.rv.lock();
                let Some(slot) = g.get_mut(&self.room) else {
                    return Err("bootstrap_room reused by another request".to_string());
                };
                let Some(p) = slot.prefill.as_mut().filter(|p| p.id == self.id) else {
                    return Err("bootstrap_room reused by another request".to_string());
                };
                if let Some(reason) = p.failed.take() {
                    return Err(reason);
                }
                let rank = p.rank;
                let notify = Arc::clone(&p.notify);
                if let Some(d) = slot.decode.as_mut().filter(|d| d.rank == rank) {
                    let sent = d
                        .done
                        .take()
                        .map(|tx| tx.send(KvOutcome::Success { cached_tokens }).is_ok());
                    slot.decode = None;
                    if sent == Some(true) {
                        slot.prefill = None;
                        Rendezvous::remove_empty(&mut g, self.room);
                        self.done = true;
                        self.rv.stats.kv_transfer();
                        return Ok(());
                    }
                    // The decode was already gone: keep waiting for another.
                    continue;
                }
                notify
            };
            tokio::select! {
                _ = notify.notified() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(format!(
                        "Request {} timed out after {:.1}s in KVPoll.Bootstrapping",
                        self.room,
                        timeout.as_secs_f64()
                    ));
                }
            }
        }
    }
}

impl Drop for PrefillHandle {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // A prefill that died (engine down) sends nothing: its decode finds
        // out through its cut connection and its heartbeat.
        let dead = self.rv.stats.engine_down.load(Ordering::Relaxed);
        let mut g = self.rv.lock();
        if let Some(slot) = g.get_mut(&self.room) {
            let Some(rank) = slot
                .prefill
                .as_ref()
                .filter(|p| p.id == self.id)
                .map(|p| p.rank)
            else {
                return;
            };
            slot.prefill = None;
            if let Some(d) = slot.decode.as_mut().filter(|d| d.rank == rank && !dead) {
                if let Some(tx) = d.done.take() {
                    let _ = tx.send(KvOutcome::Failed(PREFILL_DEAD.to_string()));
                }
                slot.decode = None;
            }
            Rendezvous::remove_empty(&mut g, self.room);
        }
    }
}

/// Removes a decode leg that leaves early and fails its prefill (ABORT); counts the
/// decode out of `kv_waiting_decodes` however its wait ended.
struct DecodeGuard {
    rv: Arc<Rendezvous>,
    room: u64,
    id: u64,
    _entry: BookEntry,
}

impl Drop for DecodeGuard {
    fn drop(&mut self) {
        self.rv
            .stats
            .kv_waiting_decodes
            .fetch_sub(1, Ordering::Relaxed);
        let mut g = self.rv.lock();
        if let Some(slot) = g.get_mut(&self.room) {
            let Some(rank) = slot
                .decode
                .as_ref()
                .filter(|d| d.id == self.id)
                .map(|d| d.rank)
            else {
                return;
            };
            slot.decode = None;
            if let Some(p) = slot.prefill.as_mut().filter(|p| p.rank == rank) {
                p.failed = Some(format!(
                    "Decode aborted the KV transfer of bootstrap_room {}",
                    self.room
                ));
                p.notify.notify_one();
            }
            Rendezvous::remove_empty(&mut g, self.room);
        }
    }
}

/// Handles one request on the rank endpoint of DP rank `rank`.
pub(crate) async fn handle_rank(
    rv: Arc<Rendezvous>,
    rank: u32,
    req: Request<Incoming>,
) -> Result<Resp, Cut> {
    let path = req.uri().path().to_string();
    if path == "/health" {
        return Ok(http::text(200, "OK"));
    }
    let Some(room) = path
        .strip_prefix("/kv/")
        .and_then(|r| r.parse::<u64>().ok())
    else {
        return Ok(http::text(404, "404: Not Found"));
    };
    if req.method() != Method::POST {
        return Ok(http::text(405, "405: Method Not Allowed"));
    }
    let body = http::read_body(req.into_body()).await?;
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let host = v
        .get("bootstrap_host")
        .and_then(Value::as_str)
        .map(str::to_string);
    let port = v
        .get("bootstrap_port")
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok());
    // A decode of other weights or KV layout: the transfer is refused at once (on real
    // engines the KV would not fit the decode's model).
    if let Some(theirs) = v.get("kv_identity").and_then(Value::as_str) {
        if theirs != rv.kv_identity {
            rv.stats.violation(Violation::KvLayoutMismatch);
            let out = json!({"status": "failed", "reason": format!(
                "KV layout mismatch: this prefill holds {}, the decode expects {theirs}",
                rv.kv_identity
            )});
            return Ok(http::json(200, &out));
        }
    }
    let outcome = rv.decode_wait(room, rank, host, port).await;
    if rv.stats.engine_down.load(Ordering::Relaxed) {
        return Err(Cut);
    }
    let out = match outcome {
        KvOutcome::Success { cached_tokens } => {
            json!({"status": "success", "cached_tokens": cached_tokens})
        }
        KvOutcome::Failed(reason) => json!({"status": "failed", "reason": reason}),
    };
    Ok(http::json(200, &out))
}
