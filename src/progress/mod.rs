//! Progress: how long a leg may plausibly take before it counts as stalled, learned per
//! worker and DP rank from the legs that completed, scaled by the request's size.
//!
//! Why: an engine can stop making progress while its `/health` and bootstrap server stay
//! fine (requests stuck in the KV transfer). No fixed timeout fits every fleet: a deadline
//! short enough to find a hung 20 ms prefill in a second would kill a healthy 8 s prefill
//! of a long prompt. So the deadline is learned from what the fleet does, and a leg is only
//! declared stalled when its *peers* (the other workers of its role) are making progress
//! meanwhile: slow for everyone is not a stall.
//!
//! What is learned, per (worker, rank), in a window of recent samples ([`Kind`]):
//! - `Prefill`: the prefill leg's time (sent → answered), with the prompt's size (pdgate
//!   uses the byte length of the prompt's raw JSON: no tokenizer on the request path);
//! - `FirstToken`: decode's time to its first whole event after the prefill answered;
//! - `Gap`: the largest gap between two events of a decode stream that ended well.
//!
//! The rule ([`judge`]): the deadline of a leg is `multiplier ×` the largest projection of
//! the recent samples of its own worker and rank *and* of its peers (a sample of `t` for a
//! size `n` projects to `t × max(1, size/n)`: never scaled down, since a short prompt can
//! queue behind a long one), clamped to `[floor, ceiling]`; with fewer than `min_samples`
//! samples on both sides together it is the ceiling. A leg past its deadline is stalled when
//! a peer completed a leg that *started after* it, or, when every peer is idle (no traffic
//! to compare with), once it is [`IDLE_PEERS_FACTOR`] times past it; while peers are busy
//! and none of them finishes a later leg first (all slowed 5× at once), nothing is declared
//! and the leg is looked at again later. A worker with no peer never stalls.
//!
//! Invariants:
//! - Pure and time-injected: times are microsecond stamps ([`stamp`]) and durations passed
//!   in; no I/O, no clock read except [`stamp`] itself.
//! - Lock-free: a window is a ring of `AtomicU64` slots (duration and size packed in one
//!   word, so a reader never sees half a sample); a worker's state is shared by every pool
//!   snapshot it appears in, like its load counters. Reading a window is at most
//!   [`WINDOW_CAP`] relaxed loads.
//! - A leg that never completed is never a sample: a stalled worker teaches nothing.
//! - A worker's stall count is reset by any completion on it, so one stuck request on a
//!   worker that keeps completing others never adds up to an ejection.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

/// Slots per window: the most samples a window holds (the configured window is at most this).
pub const WINDOW_CAP: usize = 64;

/// What a sample measures (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Prefill,
    FirstToken,
    Gap,
}

/// The bounds and learning settings of one kind of deadline.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub floor: Duration,
    pub ceiling: Duration,
    /// Deadline = multiplier × the largest recent (projected) sample.
    pub multiplier: f64,
    /// Samples needed before learning replaces the ceiling.
    pub min_samples: u32,
    /// How many of the most recent samples count (at most [`WINDOW_CAP`]).
    pub window: u32,
}

/// A ring of recent samples: `(micros << 32) | size`, 0 for an empty slot.
struct Window {
    slots: [AtomicU64; WINDOW_CAP],
    writes: AtomicU64,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            slots: std::array::from_fn(|_| AtomicU64::new(0)),
            writes: AtomicU64::new(0),
        }
    }
}

/// What a set of windows says about a size: how many samples, and the largest projection
/// (in microseconds).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Estimate {
    pub samples: u32,
    pub micros: f64,
}

impl Estimate {
    fn join(self, o: Estimate) -> Estimate {
        Estimate {
            samples: self.samples.saturating_add(o.samples),
            micros: self.micros.max(o.micros),
        }
    }

    /// The projection, when there are enough samples to trust it.
    pub fn learned(self, lim: &Limits) -> Option<f64> {
        (self.samples >= lim.min_samples.max(1)).then_some(self.micros)
    }
}

impl Window {
    fn record(&self, took: Duration, size: u32) {
        let us = took.as_micros().clamp(1, u128::from(u32::MAX)) as u64;
        let i = (self.writes.fetch_add(1, Ordering::Relaxed) % WINDOW_CAP as u64) as usize;
        self.slots[i].store(us << 32 | u64::from(size.max(1)), Ordering::Relaxed);
    }

    fn project(&self, size: u32, window: u32) -> Estimate {
        let writes = self.writes.load(Ordering::Relaxed);
        let n = writes.min(u64::from(window)).min(WINDOW_CAP as u64);
        let mut e = Estimate::default();
        for k in 0..n {
            let i = ((writes - 1 - k) % WINDOW_CAP as u64) as usize;
            let v = self.slots[i].load(Ordering::Relaxed);
            if v == 0 {
                continue;
            }
            let (us, n_i) = ((v >> 32) as f64, (v & 0xffff_ffff).max(1) as f64);
            let scale = (f64::from(size.max(1)) / n_i).max(1.0);
            e.samples += 1;
            e.micros = e.micros.max(us * scale);
        }
        e
    }
}

#[derive(Default)]
struct RankWindows {
    prefill: Window,
    first_token: Window,
    gap: Window,
    /// The rank's stream-gap bound as last computed with its peers ([`GapCache`]).
    gap_bound: GapCache,
}

/// A computed gap bound and the stamp until which it is used as it is: the bound reads
/// every rank of every peer decode, too much for each stream's start, and it moves only
/// as fast as streams end. Racy by design (two stores, read without a lock): a reader may
/// see a bound one computation old, never a torn one that is used past its time, since
/// the expiry is stored last and read first.
#[derive(Default)]
struct GapCache {
    micros: AtomicU64,
    until: AtomicU64,
}

/// How long a computed stream-gap bound is reused.
pub const GAP_BOUND_TTL: Duration = Duration::from_secs(1);

impl RankWindows {
    fn of(&self, kind: Kind) -> &Window {
        match kind {
            Kind::Prefill => &self.prefill,
            Kind::FirstToken => &self.first_token,
            Kind::Gap => &self.gap,
        }
    }
}

/// One worker's learned progress, per DP rank; shared across pool snapshots.
pub struct WorkerProgress {
    ranks: Box<[RankWindows]>,
    /// The latest start stamp of a leg on this worker that completed (0: none yet).
    mark: AtomicU64,
    /// Stalls declared on this worker since its last completion.
    stalls: AtomicU32,
    /// A re-admission probe of this worker is running (at most one at a time).
    probing: AtomicBool,
    /// Prompt tokens this replica sent the worker that have not had their first event yet
    /// (regular workers: the compute queued ahead of a new prompt; [`AwaitingFirst`]).
    awaiting: AtomicU64,
}

/// A prompt counted in its worker's [`WorkerProgress`] awaiting tokens until this is
/// dropped (its first event came, or the attempt ended); `ahead` is what was queued before
/// it.
#[derive(Debug)]
pub struct AwaitingFirst {
    progress: std::sync::Arc<WorkerProgress>,
    size: u64,
    pub ahead: u64,
}

impl Drop for AwaitingFirst {
    fn drop(&mut self) {
        self.progress
            .awaiting
            .fetch_sub(self.size, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for WorkerProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerProgress")
            .field("ranks", &self.ranks.len())
            .field("mark", &self.mark.load(Ordering::Relaxed))
            .field("stalls", &self.stalls.load(Ordering::Relaxed))
            .finish()
    }
}

impl WorkerProgress {
    pub fn new(dp: u32) -> WorkerProgress {
        WorkerProgress {
            ranks: (0..dp.max(1)).map(|_| RankWindows::default()).collect(),
            mark: AtomicU64::new(0),
            stalls: AtomicU32::new(0),
            awaiting: AtomicU64::new(0),
            probing: AtomicBool::new(false),
        }
    }

    /// Claims the worker's one probe; `None` while another runs. Freed when dropped.
    pub fn claim_probe(self: &Arc<Self>) -> Option<ProbeClaim> {
        self.probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .ok()
            .map(|_| ProbeClaim(Arc::clone(self)))
    }

    /// A leg of `kind` on `rank` took `took` for a request of `size`.
    pub fn record(&self, kind: Kind, rank: u32, took: Duration, size: u32) {
        if let Some(r) = self.ranks.get(rank as usize) {
            r.of(kind).record(took, size);
        }
    }

    /// A leg that started at `started` (a [`stamp`]) completed: the worker is making
    /// progress, and its stall count starts again from zero.
    pub fn completed(&self, started: u64) {
        self.mark.fetch_max(started, Ordering::AcqRel);
        self.stalls.store(0, Ordering::Relaxed);
    }

    /// Whether a leg that started after `started` completed here.
    pub fn progressed_since(&self, started: u64) -> bool {
        self.mark.load(Ordering::Acquire) > started
    }

    /// Counts a prompt of `size` tokens as awaiting its first event on this worker until the
    /// guard is dropped; the guard says how many tokens were awaiting before it.
    pub fn await_first(self: &std::sync::Arc<Self>, size: u32) -> AwaitingFirst {
        let size = u64::from(size);
        let ahead = self.awaiting.fetch_add(size, Ordering::AcqRel);
        AwaitingFirst {
            progress: self.clone(),
            size,
            ahead,
        }
    }

    /// Counts a stall; returns the stalls since the last completion.
    pub fn stalled(&self) -> u32 {
        self.stalls.fetch_add(1, Ordering::AcqRel).saturating_add(1)
    }

    /// Forgets the stall count (the worker was re-admitted).
    pub fn clear_stalls(&self) {
        self.stalls.store(0, Ordering::Relaxed);
    }

    /// This rank's recent samples of `kind`, projected to `size`.
    pub fn estimate(&self, kind: Kind, rank: u32, size: u32, window: u32) -> Estimate {
        self.ranks
            .get(rank as usize)
            .map(|r| r.of(kind).project(size, window))
            .unwrap_or_default()
    }

    /// Every rank's recent samples of `kind`, projected to `size` (a peer's view).
    /// The stream-gap bound cached for `rank` at stamp `now`, if still fresh.
    pub fn cached_gap_bound(&self, rank: u32, now: u64) -> Option<Duration> {
        let c = &self.ranks.get(rank as usize)?.gap_bound;
        (c.until.load(Ordering::Acquire) > now)
            .then(|| Duration::from_micros(c.micros.load(Ordering::Relaxed)))
    }

    /// Caches `bound` for `rank` from stamp `now` for [`GAP_BOUND_TTL`].
    pub fn cache_gap_bound(&self, rank: u32, bound: Duration, now: u64) {
        if let Some(r) = self.ranks.get(rank as usize) {
            r.gap_bound.until.store(0, Ordering::Release);
            r.gap_bound
                .micros
                .store(bound.as_micros() as u64, Ordering::Relaxed);
            r.gap_bound
                .until
                .store(now + GAP_BOUND_TTL.as_micros() as u64, Ordering::Release);
        }
    }

    pub fn estimate_all(&self, kind: Kind, size: u32, window: u32) -> Estimate {
        self.ranks
            .iter()
            .map(|r| r.of(kind).project(size, window))
            .fold(Estimate::default(), Estimate::join)
    }
}

/// The one probe of a worker, held by its probe task.
#[derive(Debug)]
pub struct ProbeClaim(Arc<WorkerProgress>);

impl Drop for ProbeClaim {
    fn drop(&mut self) {
        self.0.probing.store(false, Ordering::Release);
    }
}

/// What the peers of a worker say: their samples together, whether one of them completed
/// a leg that started after the leg being judged, and whether they are all idle (no leg in
/// flight: nobody else is slow, there is simply no traffic to compare with).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Peers {
    pub estimate: Estimate,
    pub progressed: bool,
    pub idle: bool,
}

impl Peers {
    /// `peers`: each peer's progress and whether it has a leg in flight.
    pub fn gather<'a>(
        peers: impl IntoIterator<Item = (&'a WorkerProgress, bool)>,
        kind: Kind,
        size: u32,
        started: u64,
        window: u32,
    ) -> Peers {
        let mut p = Peers::default();
        let (mut any, mut busy) = (false, false);
        for (w, in_flight) in peers {
            any = true;
            busy |= in_flight;
            p.estimate = p.estimate.join(w.estimate_all(kind, size, window));
            p.progressed |= w.progressed_since(started);
        }
        p.idle = any && !busy;
        p
    }
}

/// With every peer idle, a leg is stalled at this many times its deadline (no peer can show
/// progress, and none is slow either).
pub const IDLE_PEERS_FACTOR: u32 = 2;

/// The deadline from what the worker's own rank and its peers learned together (see the
/// module docs): the ceiling until they hold `min_samples` samples between them.
pub fn deadline(own: Estimate, peers: Estimate, lim: &Limits) -> Duration {
    let Some(learned) = own.join(peers).learned(lim) else {
        return lim.ceiling;
    };
    let us = (learned * lim.multiplier).clamp(0.0, u64::MAX as f64 / 2.0);
    Duration::from_micros(us as u64).clamp(lim.floor, lim.ceiling.max(lim.floor))
}

/// The verdict on a leg that has run for `elapsed` without progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Past its deadline while a peer made progress.
    Stalled { deadline: Duration },
    /// Not (yet) a stall: look again when the leg has run this long.
    LookAgainAt(Duration),
}

/// Whether a leg that has run `elapsed` is stalled.
pub fn judge(elapsed: Duration, own: Estimate, peers: &Peers, lim: &Limits) -> Verdict {
    let d = deadline(own, peers.estimate, lim);
    if elapsed < d {
        return Verdict::LookAgainAt(d);
    }
    if peers.progressed {
        return Verdict::Stalled { deadline: d };
    }
    let idle_bound = d.saturating_mul(IDLE_PEERS_FACTOR);
    if peers.idle && elapsed >= idle_bound {
        return Verdict::Stalled {
            deadline: idle_bound,
        };
    }
    // Slow for everyone (or not long enough with idle peers): look again a floor later.
    let next = elapsed + lim.floor.max(Duration::from_millis(1));
    Verdict::LookAgainAt(if peers.idle {
        next.min(idle_bound)
    } else {
        next
    })
}

static EPOCH: LazyLock<Instant> = LazyLock::new(|| {
    let now = Instant::now();
    now.checked_sub(Duration::from_secs(3600)).unwrap_or(now)
});

/// `at` as microseconds since a process-wide epoch, at least 1 (0 means "never").
pub fn stamp(at: Instant) -> u64 {
    at.saturating_duration_since(*EPOCH).as_micros() as u64 + 1
}

#[cfg(test)]
mod tests;
