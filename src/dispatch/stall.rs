//! Stall detection on the request path (the rule and the learning are
//! [`crate::progress`]'s): before the client has seen a byte, a prefill leg or a decode's
//! first event that makes no progress past its learned deadline, while its peers do (or
//! twice past it while they are idle), ends
//! the attempt as `PrefillStalled` / `DecodeStalled` — both legs are dropped (their cancel
//! guards send `/abort_request`), and the dispatcher retries with a fresh pair and fresh
//! rooms without the stalled worker. A worker that stalls `eject_after_stalls` times with
//! no completion in between leaves rotation ([`crate::pool::BreakerState::Stalled`]) until
//! a one-token probe through a real pair succeeds ([`super::probe`]).
//!
//! Invariants:
//! - What the request path adds: one timer on the caller's stack, armed at the floor (no
//!   window is read to arm it); the windows are read only when a leg outlives the floor,
//!   and peers only when it is past its own deadline (rare).
//! - The prefill deadline runs from the legs' send until the prefill answers; decode's
//!   from the prefill's answer until decode's first whole event. A decode that answers
//!   before its prefill ends the watch (the client has bytes: mid-stream is the relay's).
//! - Samples: a prefill that answered well ([`timed_prefill`]), a decode's first event
//!   after its prefill ([`StallWatch::first_byte`]), a stream's largest gap (the relay).
//! - A regular worker (`dispatch::regular`) is watched the same way with one phase
//!   ([`StallWatch::regular`]): from the send to its first event (its prompt's compute and
//!   first token, a prefill-kind sample sized by the prompt and the prompts queued ahead of
//!   it), judged against the other regular workers. No stream gap is learned from regular
//!   workers (their streams pause while they compute other prompts): their silence is
//!   judged against the configured ceiling. A stalled regular worker is ejected and probed
//!   back like the others ([`super::probe`]: a one-token request to it).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::Dispatcher;
use crate::config::ProgressConfig;
use crate::error::{FailReason, Failure};
use crate::legs::PrefillDone;
use crate::pool::backlog::BacklogHold;
use crate::pool::{WorkerStats, WorkerView};
use crate::progress::{self, Estimate, Kind, Limits, Peers, Verdict, WorkerProgress};
use crate::types::{DpRank, Pair, Role, WorkerId, WorkerIdent};

/// The limits of one kind of deadline from the config.
pub fn limits(cfg: &ProgressConfig, kind: Kind) -> Limits {
    let (floor, ceiling) = match kind {
        Kind::Prefill => (cfg.prefill_floor_ms, cfg.prefill_ceiling_ms),
        Kind::FirstToken => (cfg.first_token_floor_ms, cfg.first_token_ceiling_ms),
        Kind::Gap => (cfg.gap_floor_ms, cfg.gap_ceiling_ms),
    };
    Limits {
        floor: Duration::from_millis(floor),
        ceiling: Duration::from_millis(ceiling),
        multiplier: cfg.multiplier,
        min_samples: cfg.min_samples,
        window: cfg.window,
    }
}

fn stamp(at: Instant) -> u64 {
    progress::stamp(at.into_std())
}

/// The prefill leg, timed: an answer that came back well is a sample of its worker's rank
/// and marks the worker as progressing.
/// Its time is also observed in the worker's `/metrics` histogram, and it teaches the
/// rank's prefill pace through the leg's backlog `hold` (`pool::backlog`: with the
/// answer's prompt-cache figures), which ends with the leg however it ends.
pub(super) async fn timed_prefill<F>(
    leg: F,
    progress: Arc<WorkerProgress>,
    stats: Arc<WorkerStats>,
    rank: DpRank,
    size: u32,
    hold: Option<BacklogHold>,
) -> Result<PrefillDone, Failure>
where
    F: Future<Output = Result<PrefillDone, Failure>> + Send + 'static,
{
    let start = Instant::now();
    let r = leg.await;
    if let Ok(done) = &r {
        let end = Instant::now();
        let took = end.saturating_duration_since(start);
        stats.prefill_done(took);
        progress.record(Kind::Prefill, rank, took, size);
        progress.completed(stamp(start));
        if let Some(h) = hold {
            let figures = crate::skim::prompt_cache(&done.body)
                .map(|pc| (pc.prompt_tokens, pc.cached_tokens));
            h.answered(stamp(start), stamp(end), figures);
        }
    }
    r
}

/// Which leg the watch is timing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Prefill,
    FirstToken,
}

/// One attempt's stall watch, from the legs' send to decode's first event.
pub(super) struct StallWatch {
    enabled: bool,
    /// The role of the worker timed in the first phase: `Prefill`, or `Regular` for a
    /// regular worker's watch (one phase: the whole time to its first event).
    role: Role,
    /// A regular worker's prompt, counted as awaiting its first event until the watch ends:
    /// the prompts queued ahead of it size its deadline (see [`Self::regular`]).
    _awaiting: Option<crate::progress::AwaitingFirst>,
    /// The client asked for a stream: decode's first event is its first token. A
    /// non-streamed decode answers once its whole answer is made (its time grows with the
    /// output, not the time to first token), so it is not judged against first-token
    /// times: its decode is bounded by `timeouts.decode_first_byte_secs` alone.
    streamed: bool,
    pair: Pair,
    size: u32,
    prefill: Arc<WorkerProgress>,
    decode: Arc<WorkerProgress>,
    /// The decode's `/metrics` stats, and when the legs were sent (its first-byte time).
    decode_stats: Arc<WorkerStats>,
    sent: Instant,
    prefill_limits: Limits,
    first_token_limits: Limits,
    phase: Phase,
    started: Instant,
    started_stamp: u64,
}

impl StallWatch {
    pub fn new(
        cfg: &ProgressConfig,
        pair: Pair,
        prefill: &WorkerView,
        decode: &WorkerView,
        size: u32,
        streamed: bool,
    ) -> StallWatch {
        let now = Instant::now();
        StallWatch {
            enabled: cfg.enabled,
            role: Role::Prefill,
            _awaiting: None,
            streamed,
            pair,
            size,
            prefill: prefill.per_rank.progress.clone(),
            decode: decode.per_rank.progress.clone(),
            decode_stats: decode.shared.stats.clone(),
            sent: now,
            prefill_limits: limits(cfg, Kind::Prefill),
            first_token_limits: limits(cfg, Kind::FirstToken),
            phase: Phase::Prefill,
            started: now,
            started_stamp: stamp(now),
        }
    }

    /// A regular worker's watch (see the module docs): `w` at `t`, a prompt of `size`. A
    /// non-streamed answer is not watched: its first byte comes with the whole answer, so
    /// it is bounded by the attempt's timeout alone.
    ///
    /// Sized by the work ahead: a regular engine computes prompts in turn (SGLang's plain
    /// mode runs a prefill batch before the next), so a short prompt sent behind a long one
    /// waits for it. The deadline and the sample are for this prompt plus the prompt
    /// tokens this replica sent the worker that had no first event yet: queued is slow,
    /// not stalled, while a hung engine's first stuck prompt is judged at its own size.
    pub fn regular(
        cfg: &ProgressConfig,
        t: crate::types::Target,
        w: &WorkerView,
        size: u32,
        streamed: bool,
    ) -> StallWatch {
        let pair = Pair {
            prefill: t,
            decode: t,
        };
        let awaiting = w.per_rank.progress.await_first(size);
        let sized = u64::from(size).saturating_add(awaiting.ahead);
        let sized = u32::try_from(sized).unwrap_or(u32::MAX);
        let mut watch = StallWatch::new(cfg, pair, w, w, sized, streamed);
        watch.role = Role::Regular;
        watch.enabled = cfg.enabled && streamed;
        watch._awaiting = Some(awaiting);
        watch
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// The legs are on their way now: the prefill's clock starts. Returns the first look.
    pub fn start(&mut self) -> Instant {
        self.started = Instant::now();
        if !self.enabled {
            return self.started;
        }
        self.started_stamp = stamp(self.started);
        self.started + self.first_look()
    }

    /// The decode's progress (the relay teaches it the stream's gaps).
    pub fn decode_progress(&self) -> Arc<WorkerProgress> {
        self.decode.clone()
    }

    /// The prefill answered: decode's first-event clock starts. Returns the first look.
    pub fn prefill_done(&mut self) -> Instant {
        self.phase = Phase::FirstToken;
        if !self.streamed {
            self.enabled = false;
        }
        self.start()
    }

    fn current(&self) -> (Kind, u32, &WorkerProgress, &Limits, u32) {
        match self.phase {
            Phase::Prefill => (
                Kind::Prefill,
                self.pair.prefill.rank,
                &self.prefill,
                &self.prefill_limits,
                self.size,
            ),
            Phase::FirstToken => (
                Kind::FirstToken,
                self.pair.decode.rank,
                &self.decode,
                &self.first_token_limits,
                1,
            ),
        }
    }

    fn own(&self) -> (Estimate, Limits) {
        let (kind, rank, p, lim, size) = self.current();
        (p.estimate(kind, rank, size, lim.window), *lim)
    }

    /// Every deadline is at least the floor, so the first look is due there: nothing is
    /// read to arm it, and only a leg that outlives the floor (a long prompt, or a stall)
    /// reads the windows.
    fn first_look(&self) -> Duration {
        self.current().3.floor
    }

    /// The look is due: the next one, or the failure that ends the attempt.
    pub fn look(&self, d: &Dispatcher) -> Result<Instant, Failure> {
        let elapsed = self.started.elapsed();
        let (kind, _, _, lim, size) = self.current();
        let (role, me) = match self.phase {
            Phase::Prefill => (self.role, self.pair.prefill.worker),
            Phase::FirstToken => (Role::Decode, self.pair.decode.worker),
        };
        let snap = d.pool.load();
        let peers = snap
            .workers(role)
            .iter()
            .filter(|w| w.shared.id != me)
            .map(|w| (&*w.per_rank.progress, w.in_flight_total() > 0));
        let peers = Peers::gather(peers, kind, size, self.started_stamp, lim.window);
        let (own, lim) = self.own();
        match progress::judge(elapsed, own, &peers, &lim) {
            Verdict::LookAgainAt(at) => Ok(self.started + at),
            Verdict::Stalled { deadline } => Err(self.failure(elapsed, deadline)),
        }
    }

    fn failure(&self, elapsed: Duration, deadline: Duration) -> Failure {
        let (reason, what) = match self.phase {
            // A regular worker answers as a decode does (its failures are decode's).
            Phase::Prefill if self.role == Role::Regular => (
                FailReason::DecodeStalled,
                "the regular worker sent no first event",
            ),
            Phase::Prefill => (FailReason::PrefillStalled, "prefill made no progress"),
            Phase::FirstToken => (
                FailReason::DecodeStalled,
                "decode sent no first token after the prefill finished",
            ),
        };
        Failure::new(
            reason,
            format!(
                "{what} for {:.2}s (learned deadline {:.2}s) while its peers kept completing",
                elapsed.as_secs_f64(),
                deadline.as_secs_f64()
            ),
        )
    }

    /// Decode's first event is in hand: a sample of its time after the prefill (when the
    /// prefill answered first), and the decode is progressing.
    pub fn first_byte(&self) {
        self.decode_stats.first_byte(self.sent.elapsed());
        if self.phase == Phase::FirstToken && self.streamed {
            let rank = self.pair.decode.rank;
            self.decode
                .record(Kind::FirstToken, rank, self.started.elapsed(), 1);
        } else if self.role == Role::Regular && self.streamed {
            // A regular worker's whole time to its first event, sized by the prompt and
            // what was queued ahead of it.
            let rank = self.pair.decode.rank;
            self.decode
                .record(Kind::Prefill, rank, self.started.elapsed(), self.size);
        }
        self.decode.completed(self.started_stamp);
    }
}

impl Dispatcher {
    /// A stall was declared on `worker`'s leg: counted, and the worker taken out of
    /// rotation (with its probe started) once it stalled `eject_after_stalls` times with
    /// no completion in between.
    pub(super) fn on_stall(&self, role: Role, worker: WorkerId) {
        let snap = self.pool.load();
        let Some(w) = snap.worker(role, worker) else {
            return;
        };
        let n = w.per_rank.progress.stalled();
        let p = &self.cfg.progress;
        tracing::warn!(role = %role, worker_id = %WorkerIdent::new(role, worker), worker_url = %w.shared.url, stalls = n, "leg stalled");
        // The worker's own model's thresholds (a stall concerns the worker).
        let settings = self.settings_of(w.model.as_deref());
        if n >= p.eject_after_stalls && self.pool.eject_stalled(role, worker, &settings.breaker) {
            if let Some(claim) = w.per_rank.progress.claim_probe() {
                self.spawn_probe(role, worker, claim);
            }
        }
    }

    /// The bound on the gap between two events of a stream from `worker`'s `rank` (a
    /// decode, or a regular worker by `role`): learned from its own and its peers' (the
    /// same role's) streams that ended well, within `[progress.gap_floor_ms,
    /// progress.gap_ceiling_ms]` (the ceiling until enough streams were seen). For the
    /// relay: a worker silent for longer has stopped making progress. Computed at most
    /// once per [`progress::GAP_BOUND_TTL`] per (worker, rank), then reused.
    pub fn gap_deadline(&self, role: Role, worker: WorkerId, rank: DpRank) -> Duration {
        let lim = limits(&self.cfg.progress, Kind::Gap);
        let snap = self.pool.load();
        let me = snap.worker(role, worker);
        let now = stamp(Instant::now());
        if let Some(b) = me.and_then(|w| w.per_rank.progress.cached_gap_bound(rank, now)) {
            return b;
        }
        let own = me
            .map(|w| w.per_rank.progress.estimate(Kind::Gap, rank, 1, lim.window))
            .unwrap_or_default();
        let peers = snap
            .workers(role)
            .iter()
            .filter(|w| w.shared.id != worker)
            .map(|w| (&*w.per_rank.progress, true));
        let peers = Peers::gather(peers, Kind::Gap, 1, u64::MAX, lim.window);
        let bound = progress::deadline(own, peers.estimate, &lim);
        if let Some(w) = me {
            w.per_rank.progress.cache_gap_bound(rank, bound, now);
        }
        bound
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::dispatch::RngSource;
    use crate::pool::Pool;
    use crate::upstream::{parse_base_url, Upstream};

    #[tokio::test(start_paused = true)]
    async fn decode_gap_deadline_is_learned_per_worker_and_rank_within_bounds() {
        let pool = Arc::new(Pool::new());
        let ids: Vec<WorkerId> = (0..2)
            .map(|i| {
                let url = parse_base_url(&format!("http://127.0.0.1:{}", 3000 + i)).unwrap();
                let id = pool.add_worker(Role::Decode, url, None);
                pool.update_worker(Role::Decode, id, |w| {
                    w.facts.healthy = true;
                    w.facts.dp_size = Some(2);
                });
                id
            })
            .collect();
        let cfg = Config::default();
        let up = Upstream::new(&crate::router::upstream_settings(&cfg));
        let d = Dispatcher::new(pool.clone(), up, Arc::new(cfg.clone()), RngSource::Os);
        let p = &cfg.progress;
        let ceiling = Duration::from_millis(p.gap_ceiling_ms);
        let floor = Duration::from_millis(p.gap_floor_ms);
        assert_eq!(
            d.gap_deadline(Role::Decode, ids[0], 0),
            ceiling,
            "nothing learned"
        );
        let snap = pool.load();
        let w0 = snap.worker(Role::Decode, ids[0]).unwrap();
        for _ in 0..p.min_samples {
            w0.per_rank
                .progress
                .record(Kind::Gap, 1, Duration::from_millis(800), 1);
        }
        // Rank 1 of worker 0 learned 800 ms gaps: 3 x 800 ms.
        assert_eq!(
            d.gap_deadline(Role::Decode, ids[0], 1),
            Duration::from_millis(2400)
        );
        // Its rank 0 has none of its own, but its peers' view does not include itself:
        // the ceiling. Worker 1 learns from its peer (worker 0).
        assert_eq!(d.gap_deadline(Role::Decode, ids[0], 0), ceiling);
        assert_eq!(
            d.gap_deadline(Role::Decode, ids[1], 0),
            Duration::from_millis(2400)
        );
        // Fast gaps are held up by the floor.
        let w1 = snap.worker(Role::Decode, ids[1]).unwrap();
        for _ in 0..64 {
            w0.per_rank
                .progress
                .record(Kind::Gap, 1, Duration::from_millis(5), 1);
            w1.per_rank
                .progress
                .record(Kind::Gap, 0, Duration::from_millis(5), 1);
        }
        // The bound computed above is reused until it is a second old...
        assert_eq!(
            d.gap_deadline(Role::Decode, ids[1], 0),
            Duration::from_millis(2400)
        );
        tokio::time::advance(progress::GAP_BOUND_TTL).await;
        // ...then recomputed.
        assert_eq!(d.gap_deadline(Role::Decode, ids[1], 0), floor);
    }
}
