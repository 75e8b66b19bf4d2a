//! Passive health: a circuit breaker per worker (each worker serves one leg, so this is per
//! (worker, leg)), fed by the outcomes of real requests.
//!
//! Closed → (`failure_threshold` failures in a row) → Open: out of rotation for the open
//! time, which doubles with every re-open up to `max_open_ms` → HalfOpen: back in rotation
//! for exactly one trial request → success closes it, failure re-opens it.
//!
//! A trial is held by a [`TrialGuard`]: a trial that ends without a verdict on this
//! worker's leg (a 4xx, a failure blamed on the other leg, no partner available, a
//! request timeout, a client that went away, ...) releases the trial when its guard drops,
//! so the next request can be the trial. Trials carry the epoch of the half-open period
//! that issued them, so a late guard never frees a later period's trial.
//!
//! Invariants:
//! - Attribution is per leg: only failures blamed on this worker's own leg count (a prefill
//!   error never trips a decode's breaker); client-caused 4xx and client disconnects never
//!   count (see [`FailReason::is_worker_fault`]).
//! - Ejection cap: passive signals alone never hold open more than
//!   `max_ejection_ratio` of a pool (rounded down), so they cannot empty a pool. A pool is
//!   the workers of one role serving the same model (each model has its own pools, and
//!   may have its own ratio: `[models.settings."NAME".breaker]`).
//! - The counters are atomics shared across snapshots; only transitions rebuild the
//!   snapshot, through the pool's single writer, in a task: a request whose outcome moves
//!   a breaker swaps the state atomically and hands the rebuild off (coalesced: at most one
//!   pending), never taking the writer lock itself.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::config::BreakerConfig;
use crate::error::FailReason;
use crate::telemetry;
use crate::types::{Role, WorkerId, WorkerIdent};

use super::Pool;

/// The breaker's state as the snapshot sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
    /// Out of rotation for lack of progress (see `crate::progress`): no timer brings it
    /// back, only a leg that succeeds on it (a probe through a real pair).
    Stalled,
}

impl BreakerState {
    fn from_u8(v: u8) -> BreakerState {
        match v {
            1 => BreakerState::Open,
            2 => BreakerState::HalfOpen,
            3 => BreakerState::Stalled,
            _ => BreakerState::Closed,
        }
    }
    fn as_u8(self) -> u8 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::Open => 1,
            BreakerState::HalfOpen => 2,
            BreakerState::Stalled => 3,
        }
    }
    pub fn label(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::HalfOpen => "half_open",
            BreakerState::Stalled => "stalled",
        }
    }
    /// Out of rotation (open, or stalled).
    pub fn is_out(self) -> bool {
        matches!(self, BreakerState::Open | BreakerState::Stalled)
    }
}

/// One worker's breaker; shared by every snapshot the worker appears in.
#[derive(Debug, Default)]
pub struct Breaker {
    consecutive: AtomicU32,
    state: AtomicU8,
    /// The half-open period whose trial is out (0: none).
    trial: AtomicU64,
    /// Counts half-open periods (the current one's number; 0 before the first).
    epoch: AtomicU64,
    reopens: AtomicU32,
}

impl Breaker {
    pub fn state(&self) -> BreakerState {
        BreakerState::from_u8(self.state.load(Ordering::Acquire))
    }

    /// Whether a half-open breaker's one trial is already out.
    pub fn trial_taken(&self) -> bool {
        self.trial.load(Ordering::Acquire) != 0
    }

    /// Claims the half-open trial; `None` when someone else has it. The trial is released
    /// when the guard drops (after the verdict, or without one).
    pub fn take_trial(self: &Arc<Self>) -> Option<TrialGuard> {
        let epoch = self.epoch.load(Ordering::Acquire);
        if epoch == 0 {
            return None;
        }
        self.trial
            .compare_exchange(0, epoch, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| TrialGuard {
                breaker: Arc::clone(self),
                epoch,
            })
    }

    /// Starts a half-open period: a new epoch with its trial free.
    fn begin_half_open(&self) {
        let epoch = self.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        self.trial.store(0, Ordering::Release);
        debug_assert!(epoch != 0);
    }
}

/// A half-open breaker's one trial, held by the request that is the trial. Dropping it
/// frees the trial of its own half-open period (a no-op once the breaker moved on).
#[derive(Debug)]
pub struct TrialGuard {
    breaker: Arc<Breaker>,
    epoch: u64,
}

impl Drop for TrialGuard {
    fn drop(&mut self) {
        let _ =
            self.breaker
                .trial
                .compare_exchange(self.epoch, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// A failure on a prefill's leg that may mean its bootstrap ranks changed.
fn bootstrap_signal(reason: FailReason) -> bool {
    matches!(
        reason,
        FailReason::BootstrapUnreachable
            | FailReason::BootstrapNotReady
            | FailReason::BootstrapRankMissing
            | FailReason::PrefillConnect
            | FailReason::PrefillLost
            | FailReason::KvTransferFailed
    )
}

fn open_for(cfg: &BreakerConfig, reopens: u32) -> Duration {
    let base = cfg.open_ms.max(1);
    let ms = base
        .saturating_mul(1u64 << reopens.min(16))
        .min(cfg.max_open_ms.max(base));
    Duration::from_millis(ms)
}

impl Pool {
    /// A leg on `id` succeeded.
    pub fn report_success(self: &Arc<Self>, role: Role, id: WorkerId) {
        let Some(b) = self.breaker_counting(role, id, None) else {
            return;
        };
        b.consecutive.store(0, Ordering::Relaxed);
        if matches!(b.state(), BreakerState::HalfOpen | BreakerState::Stalled) {
            b.reopens.store(0, Ordering::Relaxed);
            self.set_breaker(role, id, &b, BreakerState::Closed);
        }
    }

    /// Takes `id` out of rotation for lack of progress, within the ejection cap. True when
    /// this call moved it there (the caller starts its probe); false when it was already
    /// out, or the cap keeps it in.
    pub fn eject_stalled(self: &Arc<Self>, role: Role, id: WorkerId, cfg: &BreakerConfig) -> bool {
        let Some(b) = self.breaker(role, id) else {
            return false;
        };
        if b.state() != BreakerState::Closed && b.state() != BreakerState::HalfOpen {
            return false;
        }
        // The cap's check and the transition under one lock (see `Pool::eject_lock`).
        let _one = self.eject_lock.lock().unwrap_or_else(|p| p.into_inner());
        if !self.may_eject(role, id, cfg) {
            tracing::warn!(worker_id = %WorkerIdent::new(role, id), worker_url = %url_of(self, role, id), "stalled worker kept in rotation: the ejection cap is reached");
            metrics::counter!(telemetry::BREAKER_EJECTION_CAPPED, "role" => role.as_str())
                .increment(1);
            return false;
        }
        let from = b.state.load(Ordering::Acquire);
        if b.state
            .compare_exchange(
                from,
                BreakerState::Stalled.as_u8(),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            return false;
        }
        tracing::warn!(worker_id = %WorkerIdent::new(role, id), worker_url = %url_of(self, role, id), "worker stalled: out of rotation until a probe through a real pair succeeds");
        metrics::counter!(telemetry::BREAKER_TRANSITIONS, "role" => role.as_str(), "to" => BreakerState::Stalled.label()).increment(1);
        self.rebuild_soon();
        true
    }

    /// A leg on `id` failed for `reason`.
    pub fn report_failure(
        self: &Arc<Self>,
        role: Role,
        id: WorkerId,
        reason: FailReason,
        cfg: &BreakerConfig,
    ) {
        if role == Role::Prefill && bootstrap_signal(reason) {
            // The prefill's rank routes may have changed: its tracker re-reads them now
            // (coalesced, within its read budget).
            if let Some(w) = self.load().worker(role, id) {
                w.shared.refresh.notify_one();
            }
        }
        let counted = self.breaker_counting(role, id, Some(reason));
        // A regular worker's one leg fails with decode's reasons (`dispatch::regular`).
        let leg = match reason.leg() {
            Some(Role::Decode) if role == Role::Regular => Some(Role::Regular),
            other => other,
        };
        if !reason.is_worker_fault() || leg != Some(role) || cfg.failure_threshold == 0 {
            return;
        }
        let Some(b) = counted else {
            return;
        };
        let n = b.consecutive.fetch_add(1, Ordering::Relaxed) + 1;
        match b.state() {
            BreakerState::HalfOpen => {
                let reopens = b.reopens.fetch_add(1, Ordering::Relaxed) + 1;
                self.open(role, id, &b, cfg, reopens, reason);
            }
            BreakerState::Closed if n >= cfg.failure_threshold => {
                // The cap's check and the opening under one lock: two failures at once
                // cannot both pass it (see `Pool::eject_lock`).
                let _one = self.eject_lock.lock().unwrap_or_else(|p| p.into_inner());
                if b.state() != BreakerState::Closed {
                    // Opened by a failure that held the lock first.
                } else if self.may_eject(role, id, cfg) {
                    self.open(role, id, &b, cfg, 0, reason);
                } else {
                    tracing::warn!(worker_id = %WorkerIdent::new(role, id), worker_url = %url_of(self, role, id), "breaker would open but the ejection cap is reached");
                    metrics::counter!(telemetry::BREAKER_EJECTION_CAPPED, "role" => role.as_str())
                        .increment(1);
                }
            }
            _ => {}
        }
    }

    /// The worker's breaker, the leg's outcome counted in its stats on the way
    /// (`None`: it succeeded).
    fn breaker_counting(
        &self,
        role: Role,
        id: WorkerId,
        failed: Option<FailReason>,
    ) -> Option<Arc<Breaker>> {
        let snap = self.load();
        let w = snap.worker(role, id)?;
        w.shared.stats.outcome(failed);
        Some(w.shared.breaker.clone())
    }

    fn breaker(&self, role: Role, id: WorkerId) -> Option<Arc<Breaker>> {
        self.load()
            .worker(role, id)
            .map(|w| w.shared.breaker.clone())
    }

    /// Whether opening one more breaker in `id`'s pool (its role's workers of its model)
    /// stays within the ejection cap.
    fn may_eject(&self, role: Role, id: WorkerId, cfg: &BreakerConfig) -> bool {
        let snap = self.load();
        let Some(me) = snap.worker(role, id) else {
            return false;
        };
        let (mut size, mut open) = (0usize, 0usize);
        for w in snap.workers(role).iter().filter(|w| w.model == me.model) {
            size += 1;
            open += usize::from(w.shared.breaker.state() != BreakerState::Closed);
        }
        let cap = (cfg.max_ejection_ratio * size as f64).floor() as usize;
        open < cap
    }

    fn open(
        self: &Arc<Self>,
        role: Role,
        id: WorkerId,
        b: &Arc<Breaker>,
        cfg: &BreakerConfig,
        reopens: u32,
        reason: FailReason,
    ) {
        let dur = open_for(cfg, reopens);
        tracing::warn!(worker_id = %WorkerIdent::new(role, id), worker_url = %url_of(self, role, id), reason = reason.as_str(), open_for = ?dur, "circuit opened");
        self.set_breaker(role, id, b, BreakerState::Open);
        let pool = Arc::clone(self);
        let b = Arc::clone(b);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                tokio::time::sleep(dur).await;
                if b.state() == BreakerState::Open {
                    b.begin_half_open();
                    pool.set_breaker(role, id, &b, BreakerState::HalfOpen);
                }
            });
        }
    }

    fn set_breaker(self: &Arc<Self>, role: Role, id: WorkerId, b: &Breaker, to: BreakerState) {
        let from = BreakerState::from_u8(b.state.swap(to.as_u8(), Ordering::AcqRel));
        if from == to {
            return;
        }
        if to == BreakerState::Closed {
            b.consecutive.store(0, Ordering::Relaxed);
        }
        tracing::warn!(worker_id = %WorkerIdent::new(role, id), worker_url = %url_of(self, role, id), from = from.label(), to = to.label(), "circuit breaker");
        metrics::counter!(telemetry::BREAKER_TRANSITIONS, "role" => role.as_str(), "to" => to.label()).increment(1);
        // Rebuild the snapshot so routability follows the new state.
        self.rebuild_soon();
    }

    /// Hands a snapshot rebuild to a task (at most one pending; a transition after it
    /// started schedules another). Outside a runtime, rebuilds here.
    fn rebuild_soon(self: &Arc<Self>) {
        if self.rebuild_pending.swap(true, Ordering::AcqRel) {
            return;
        }
        let pool = Arc::clone(self);
        let task = async move {
            pool.rebuild_pending.store(false, Ordering::Release);
            pool.update_master(|_| {});
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(task);
            }
            Err(_) => {
                self.rebuild_pending.store(false, Ordering::Release);
                self.update_master(|_| {});
            }
        }
    }
}

/// A worker's URL for a log line (`-` once it left the pool).
fn url_of(pool: &Pool, role: Role, id: WorkerId) -> String {
    pool.load()
        .worker(role, id)
        .map_or_else(|| "-".to_string(), |w| w.shared.url.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::parse_base_url;

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 3,
            open_ms: 50,
            max_open_ms: 400,
            max_ejection_ratio: 0.5,
        }
    }

    /// The snapshot once the rebuilds handed off by transitions ran.
    async fn settled(pool: &Arc<Pool>) -> Arc<crate::pool::Snapshot> {
        tokio::task::yield_now().await;
        pool.load_full()
    }

    fn pool(n: usize) -> Arc<Pool> {
        let pool = Arc::new(Pool::new());
        for i in 0..n {
            let id = pool.add_worker(
                Role::Decode,
                parse_base_url(&format!("http://127.0.0.1:{}", 2000 + i)).unwrap(),
                None,
            );
            pool.update_worker(Role::Decode, id, |w| w.facts.healthy = true);
        }
        pool
    }

    #[tokio::test(start_paused = true)]
    async fn opens_half_opens_and_closes() {
        let pool = pool(2);
        let c = cfg();
        let w = WorkerId(0);
        for _ in 0..2 {
            pool.report_failure(Role::Decode, w, FailReason::DecodeStatus, &c);
        }
        assert_eq!(settled(&pool).await.decode_routable.len(), 2);
        pool.report_failure(Role::Decode, w, FailReason::DecodeStatus, &c);
        assert_eq!(
            settled(&pool).await.decode_routable.len(),
            1,
            "open: out of rotation"
        );
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(
            settled(&pool).await.decode_routable.len(),
            2,
            "half-open: back for a trial"
        );
        assert_eq!(
            pool.breaker(Role::Decode, w).unwrap().state(),
            BreakerState::HalfOpen
        );
        // The trial fails: open again, for twice as long.
        pool.report_failure(Role::Decode, w, FailReason::DecodeBroken, &c);
        assert_eq!(settled(&pool).await.decode_routable.len(), 1);
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert_eq!(
            settled(&pool).await.decode_routable.len(),
            1,
            "backoff doubled the open time"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(settled(&pool).await.decode_routable.len(), 2);
        pool.report_success(Role::Decode, w);
        assert_eq!(
            pool.breaker(Role::Decode, w).unwrap().state(),
            BreakerState::Closed
        );
    }

    #[test]
    fn trials_are_released_by_their_own_guard_only() {
        let b = Arc::new(Breaker::default());
        assert!(
            b.take_trial().is_none(),
            "no trial before a half-open period"
        );
        b.begin_half_open();
        let first = b.take_trial().expect("the trial");
        assert!(b.take_trial().is_none(), "one trial at a time");
        drop(first);
        assert!(!b.trial_taken(), "released without a verdict");
        let late = b.take_trial().expect("taken again");
        // The breaker moves on (re-opened, half-open again) while `late` is still held.
        b.begin_half_open();
        let current = b.take_trial().expect("the new period's trial");
        drop(late);
        assert!(b.trial_taken(), "a late guard never frees a later trial");
        drop(current);
        assert!(!b.trial_taken());
    }

    #[tokio::test(start_paused = true)]
    async fn attribution_and_client_errors() {
        let pool = pool(2);
        let c = cfg();
        for _ in 0..10 {
            // Prefill-blamed and client-caused reasons never trip a decode breaker.
            pool.report_failure(Role::Decode, WorkerId(0), FailReason::PrefillStatus, &c);
            pool.report_failure(Role::Decode, WorkerId(0), FailReason::DecodeRejected, &c);
            pool.report_failure(
                Role::Decode,
                WorkerId(0),
                FailReason::ClientDisconnected,
                &c,
            );
        }
        assert_eq!(settled(&pool).await.decode_routable.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn ejection_cap_keeps_part_of_the_pool() {
        let pool = pool(2);
        let c = cfg();
        for w in [WorkerId(0), WorkerId(1)] {
            for _ in 0..3 {
                pool.report_failure(Role::Decode, w, FailReason::DecodeConnect, &c);
            }
        }
        assert_eq!(
            settled(&pool).await.decode_routable.len(),
            1,
            "only half the pool may be ejected"
        );
        let single = self::pool(1);
        for _ in 0..5 {
            single.report_failure(Role::Decode, WorkerId(0), FailReason::DecodeConnect, &c);
        }
        assert_eq!(
            settled(&single).await.decode_routable.len(),
            1,
            "a pool of one is never emptied by passive signals"
        );
    }

    /// Failures of many workers at once, from many threads: the cap's check and the
    /// opening are one step, so no more than the cap is ever ejected. (Found by reading:
    /// the check came first and the opening after, so two threads could both pass it. The
    /// window is a few instructions wide, too narrow for this test to catch it reliably
    /// without the lock; it guards the invariant.)
    #[test]
    fn the_ejection_cap_holds_under_concurrent_failures() {
        let c = BreakerConfig {
            failure_threshold: 1,
            ..cfg()
        };
        for _ in 0..50 {
            let pool = pool(8);
            let start = Arc::new(std::sync::Barrier::new(8));
            let threads: Vec<_> = (0..8u32)
                .map(|w| {
                    let (pool, c, start) = (pool.clone(), c.clone(), start.clone());
                    std::thread::spawn(move || {
                        start.wait();
                        pool.report_failure(
                            Role::Decode,
                            WorkerId(w),
                            FailReason::DecodeConnect,
                            &c,
                        );
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            let snap = pool.load();
            let out = snap
                .decodes
                .iter()
                .filter(|w| w.shared.breaker.state() != BreakerState::Closed)
                .count();
            assert!(out <= 4, "{out} of 8 ejected, cap 4");
            assert_eq!(out, 4, "the cap is reached, not undershot");
        }
    }

    /// The cap is per model: two models' failures cannot empty either's pool, however
    /// large the other's.
    #[tokio::test(start_paused = true)]
    async fn the_ejection_cap_is_per_model() {
        let pool = pool(6);
        // Decodes 0, 1 serve "a"; 2..6 serve "b".
        for w in 0..6u32 {
            let m: Arc<str> = Arc::from(if w < 2 { "a" } else { "b" });
            pool.set_model(Role::Decode, WorkerId(w), Some(m));
        }
        let c = BreakerConfig {
            failure_threshold: 1,
            ..cfg()
        };
        for w in 0..6u32 {
            pool.report_failure(Role::Decode, WorkerId(w), FailReason::DecodeConnect, &c);
        }
        let snap = settled(&pool).await;
        let open = |model: &str| {
            snap.decodes
                .iter()
                .filter(|w| w.model.as_deref() == Some(model))
                .filter(|w| w.shared.breaker.state() != BreakerState::Closed)
                .count()
        };
        assert_eq!((open("a"), open("b")), (1, 2));
    }

    /// A request whose outcome moves breakers does not rebuild the snapshot itself: the
    /// rebuild is handed to a task, and transitions before it runs share one rebuild.
    #[tokio::test(start_paused = true)]
    async fn transitions_hand_the_rebuild_to_one_task() {
        let pool = pool(4);
        let c = BreakerConfig {
            max_ejection_ratio: 1.0,
            ..cfg()
        };
        let v = pool.load().version;
        for w in 0..2 {
            for _ in 0..3 {
                pool.report_failure(Role::Decode, WorkerId(w), FailReason::DecodeStatus, &c);
            }
        }
        assert_eq!(pool.load().version, v, "no rebuild on the caller's thread");
        let snap = settled(&pool).await;
        assert_eq!(snap.version, v + 1, "two transitions, one rebuild");
        assert_eq!(snap.decode_routable.len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn stalled_stays_out_until_a_success_and_respects_the_cap() {
        let pool = pool(2);
        let c = cfg();
        let w = WorkerId(0);
        assert!(pool.eject_stalled(Role::Decode, w, &c));
        assert!(!pool.eject_stalled(Role::Decode, w, &c), "already out");
        assert_eq!(settled(&pool).await.decode_routable.len(), 1);
        assert_eq!(
            pool.breaker(Role::Decode, w).unwrap().state().label(),
            "stalled"
        );
        // No timer brings it back, and failures keep it where it is.
        tokio::time::sleep(Duration::from_secs(120)).await;
        pool.report_failure(Role::Decode, w, FailReason::DecodeStatus, &c);
        assert_eq!(
            pool.breaker(Role::Decode, w).unwrap().state(),
            BreakerState::Stalled
        );
        // The ejection cap holds for stalls too: the other half stays.
        assert!(!pool.eject_stalled(Role::Decode, WorkerId(1), &c));
        assert_eq!(settled(&pool).await.decode_routable.len(), 1);
        // A success (a probe through a real pair) re-admits it.
        pool.report_success(Role::Decode, w);
        assert_eq!(
            pool.breaker(Role::Decode, w).unwrap().state(),
            BreakerState::Closed
        );
        assert_eq!(settled(&pool).await.decode_routable.len(), 2);
    }
}
