//! Decode capacity per (worker, DP rank): how many requests the engine runs at once, how
//! many it runs now as far as this replica can tell, and the reservations that keep
//! pdgate from sending more. Engine state, like load: it lives beside the snapshot (atomics
//! shared by every snapshot the worker appears in), the load poller and the health
//! checker write what the engine reports, `policy` reads it, and the request path takes a
//! [`Reservation`] before either leg is sent.
//!
//! What a rank holds, as this replica estimates it (its *occupancy*):
//!
//! ```text
//! occupancy = max(engine_busy + new_live − released_old, own_live)
//! ```
//!
//! - `engine_busy`: running + waiting requests the engine reported at the last poll
//!   (every replica's requests, one poll old);
//! - `new_live`: this replica's reservations taken since that poll and still held (the
//!   engine's figure cannot contain them yet);
//! - `released_old`: reservations taken before that poll and released since (the
//!   engine's figure still counts them);
//! - `own_live`: every reservation this replica holds (a floor: a failed poll or an
//!   engine that reports nothing leaves pdgate's own count).
//!
//! A request takes one slot per prompt instance (a batch or `n > 1` runs each instance as
//! a request of its own on the engine). A reservation is refused when it would take the
//! occupancy past the capacity, unless the rank holds nothing. The check and the increment of
//! `own_live`/`new_live` are one compare-and-swap on a packed word, so two requests of
//! this replica never both take the last slot. Other replicas' reservations reach this
//! replica only through the engine's figure: between two polls, each of `R` replicas
//! may admit up to `capacity` requests the others cannot see, so the engine may hold up
//! to `capacity + (R − 1) × (requests each replica admits per poll interval)` — bounded
//! by `R × capacity` in the worst case, and close to `capacity` when polls are frequent
//! against the admission rate. The engine queues any excess itself (as it would without
//! pdgate). The same window, counted in KV tokens, bounds a request by the engine's KV
//! room: `prompt + max_new_tokens` must fit into `max_total_num_tokens` minus what is in
//! use (unless the rank holds nothing of this replica's, where waiting cannot help).
//!
//! With the replica count `R` known (`admission.replicas`), each replica also holds at most
//! its *share* of a rank's capacity ([`share`]): `⌊capacity / R⌋`, plus one of the
//! `capacity mod R` remainder slots when its index is known and the rank's turn gives it
//! one. The shares of `R` replicas with distinct indexes add up to the capacity, so
//! together they never send a rank more than it runs, whatever their polls saw
//! (ARCHITECTURE.md, "Admission across replicas", has the argument and the exceptions).
//! The share is checked in the same compare-and-swap as the occupancy, against this
//! replica's own reservations; `R = 0` (unknown) checks nothing more than before.
//!
//! A decode whose last report shows requests in its pre-allocation queue
//! (`disaggregation.decode_prealloc_queue_reqs`: arrived, handshaking, or waiting for KV
//! room or a running slot while their prefill's bootstrap clock runs) has no room for new
//! requests, whatever the occupancy says (the engine's capacity may be unknown, or smaller
//! than its figure, or its KV full), when that queue is longer than this replica's
//! reservations taken in the window before the poll and still held: those may be there
//! only for their handshake (milliseconds on a healthy engine, and a busy rank always has
//! some), anything more has waited a poll interval (with a shorter handshake) or is
//! another replica's. While closed, the replica sends the rank nothing, so it stays closed
//! until a report shows the queue drained (0); while requests wait for a slot the decode
//! pollers poll early ([`CapacitySignal::want_poll`]). New requests then wait in pdgate's queue,
//! where they can still go to another rank, not in the engine's. A rank whose report has
//! no such figure (older engines, a prefill, a failed poll) is judged as before; with
//! `learn_from_engine` off the queue is not looked at. Other replicas' fresh requests are
//! not told apart: they may close a busy rank until the next early poll (100 ms) when
//! nothing waits for long.
//!
//! Invariants: lock-free (atomics only); a rank whose last report shows a pre-allocation
//! queue longer than this replica's fresh reservations admits nothing (with
//! `learn_from_engine`), one with no such report as before; a [`Reservation`] gives back
//! exactly what it took when dropped (the response body ended, or the attempt failed),
//! whatever the epoch;
//! waiters are woken through [`CapacitySignal`] only when some wait, so a release costs
//! two atomics and a load when nobody waits; with `R` known and an index, this replica's
//! reservations on a rank never exceed its share (one exception: a request larger than a
//! share of at least one slot goes alone to a rank that holds nothing).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

pub mod share;

pub use share::share;

/// How a rank's capacity is decided (from `[capacity]`), per request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    /// Requests per decode DP rank set by config; 0 = none (use the engine's figure).
    pub override_per_rank: u64,
    /// Whether the engine's reported capacity counts.
    pub learn_from_engine: bool,
    /// Whether KV tokens bound admission too.
    pub kv_bound: bool,
    /// Replicas sharing every decode rank (`admission.replicas`); 0 = unknown: no share.
    pub replicas: u32,
    /// This replica's index among them (`admission.replica_index`), which decides the
    /// remainder slots; `None`: no remainder slot.
    pub replica_index: Option<u32>,
    /// With the replica count unknown, take fresh requests on a rank only in proportion
    /// to this replica's part of its reported load (`capacity.proportional_share`).
    pub proportional: bool,
    /// The engines' bootstrap timeout in ms (`admission.engine_bootstrap_timeout_secs`);
    /// 0 = not judged.
    pub bootstrap_timeout_ms: u64,
}

impl Limits {
    /// The limits the `[capacity]` settings `c` and the replica-wide `[admission]`
    /// settings `a` (the replica count and index behind the shares) set.
    pub fn from_config(
        c: &crate::config::CapacityConfig,
        a: &crate::config::AdmissionConfig,
    ) -> Limits {
        Limits {
            override_per_rank: c.decode_max_running_per_rank,
            learn_from_engine: c.learn_from_engine,
            kv_bound: c.kv_bound,
            replicas: a.replicas,
            replica_index: a.replica_index,
            proportional: c.proportional_share,
            bootstrap_timeout_ms: a.engine_bootstrap_timeout_secs.saturating_mul(1000),
        }
    }
}

/// What one request needs of a decode rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Need {
    pub limits: Limits,
    /// Estimated KV tokens the request holds (prompt + max new tokens).
    pub tokens: u64,
    /// Running slots it takes: one per prompt instance (a batch or `n > 1` runs each
    /// instance as its own request on the engine); 0 counts as 1.
    pub slots: u64,
}

impl Need {
    fn slots(&self) -> u64 {
        self.slots.max(1)
    }
}

/// Whether `slots` more fit under `cap` at `occupancy` (0 = no limit). A rank that holds
/// nothing takes any request, even one larger than the capacity: waiting would not help.
fn fits(cap: u64, occupancy: u64, slots: u64) -> bool {
    cap == 0 || occupancy == 0 || occupancy.saturating_add(slots) <= cap
}

const LOW: u64 = 0xFFFF_FFFF;

/// What the engine said about one rank at one poll (`None`: not reported).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Reported {
    /// Running + waiting requests.
    pub busy: Option<u64>,
    /// Requests the rank runs at once.
    pub max_running: Option<u64>,
    /// KV tokens in use (or used + pending, where reported).
    pub tokens: Option<u64>,
    /// The rank's KV capacity in tokens.
    pub max_tokens: Option<u64>,
    /// Requests in the decode's pre-allocation queue
    /// (`disaggregation.decode_prealloc_queue_reqs`): arrived, not yet holding KV room.
    pub prealloc: Option<u64>,
    /// Waiting requests (`num_waiting_reqs`), which `busy` counts too.
    pub waiting: Option<u64>,
}

/// One decode DP rank's capacity state.
#[derive(Debug, Default)]
pub struct RankCapacity {
    /// Where the rank stands in the turn of the remainder slots ([`share`]): its position
    /// among all decode ranks in URL order, set by the pool at every snapshot (every
    /// replica that sees the same decodes sets it alike), so that the ranks of several
    /// decodes do not all give their spare slots to the same replicas.
    turn: AtomicU32,
    /// Capacity the engine reported (0 = unknown).
    engine_cap: AtomicU64,
    /// Running + waiting at the last poll.
    engine_busy: AtomicU64,
    /// KV tokens in use at the last poll, and the KV capacity (0 = not reported).
    engine_tokens: AtomicU64,
    engine_max_tokens: AtomicU64,
    /// The pre-allocation queue at the last poll, plus one (0 = not reported).
    engine_prealloc: AtomicU64,
    /// Waiting requests at the last poll, plus one (0 = not reported).
    engine_waiting: AtomicU64,
    /// How long a reservation on the rank is held (send to the answer's end), a moving
    /// average in ms (0 = none measured yet): the pace at which the rank frees slots.
    hold_ms: AtomicU64,
    /// Whether that queue was longer than this replica's reservations taken in the window
    /// before the poll and still held (which may be there only for their handshake).
    engine_queued: AtomicBool,
    /// This replica's reservations on the rank when the last poll was stored.
    own_at_poll: AtomicU64,
    /// Other replicas' requests on the rank as this replica estimates them: the most the
    /// engine reported beyond this replica's own count at the last two polls (see
    /// [`RankCapacity::allowance`]), and that figure at the last poll alone.
    others: AtomicU64,
    others_last: AtomicU64,
    /// The last poll's random word, which rounds this replica's proportional part of
    /// the free slots up or down (see [`RankCapacity::allowance`]).
    coin: AtomicU64,
    /// Bumped at every poll.
    epoch: AtomicU64,
    /// `own_live << 32 | new_live`.
    reqs: AtomicU64,
    released_old: AtomicU64,
    /// Of those, the ones released while requests of this replica waited for a slot:
    /// they may be refilled before the next poll (see [`RankCapacity::allowance`]); a slot
    /// released with nobody waiting goes back to the fleet (others may see it free).
    refillable: AtomicU64,
    own_tokens: AtomicU64,
    new_tokens: AtomicU64,
    released_old_tokens: AtomicU64,
}

impl RankCapacity {
    /// The capacity that applies (0 = unlimited).
    pub fn limit(&self, l: &Limits) -> u64 {
        if l.override_per_rank > 0 {
            l.override_per_rank
        } else if l.learn_from_engine {
            self.engine_cap.load(Ordering::Relaxed)
        } else {
            0
        }
    }

    /// The engine-reported capacity (0 = unknown).
    pub fn engine_cap(&self) -> u64 {
        self.engine_cap.load(Ordering::Relaxed)
    }

    /// The pre-allocation queue the last poll reported (`None`: not reported).
    pub fn prealloc_queue(&self) -> Option<u64> {
        self.engine_prealloc.load(Ordering::Relaxed).checked_sub(1)
    }

    /// Whether the engine's last report shows more requests queued before pre-allocation
    /// than this replica's fresh ones explain, and the engine's reports count
    /// (`learn_from_engine`): no new request goes there until a report shows the queue
    /// drained (while closed, this replica sends the rank nothing fresh).
    fn engine_queues(&self, l: &Limits) -> bool {
        l.learn_from_engine && self.queue_closes()
    }

    /// Whether the last report's pre-allocation queue closes the rank (see the module
    /// docs), where the engine's reports count.
    pub fn queue_closes(&self) -> bool {
        self.engine_queued.load(Ordering::Relaxed)
    }

    fn occupancy_of(&self, packed: u64) -> u64 {
        let (own, new) = (packed >> 32, packed & LOW);
        let busy = self.engine_busy.load(Ordering::Relaxed);
        let old = self.released_old.load(Ordering::Relaxed);
        busy.saturating_add(new).saturating_sub(old).max(own)
    }

    /// Requests the rank holds as this replica estimates it (see the module docs).
    pub fn occupancy(&self) -> u64 {
        self.occupancy_of(self.reqs.load(Ordering::Acquire))
    }

    /// This replica's reservations on the rank.
    pub fn own(&self) -> u64 {
        self.reqs.load(Ordering::Relaxed) >> 32
    }

    /// KV tokens the rank holds (engine's figure, corrected by this replica's
    /// reservations since), when the engine reports tokens; else `None`.
    pub fn tokens(&self) -> Option<u64> {
        if self.engine_max_tokens.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let t = self.engine_tokens.load(Ordering::Relaxed);
        let new = self.new_tokens.load(Ordering::Relaxed);
        let old = self.released_old_tokens.load(Ordering::Relaxed);
        let own = self.own_tokens.load(Ordering::Relaxed);
        Some(t.saturating_add(new).saturating_sub(old).max(own))
    }

    fn kv_fits(&self, need: &Need, occupancy: u64) -> bool {
        if !need.limits.kv_bound || occupancy == 0 {
            return true;
        }
        let max = self.engine_max_tokens.load(Ordering::Relaxed);
        match self.tokens() {
            Some(used) if max > 0 => used.saturating_add(need.tokens) <= max,
            _ => true,
        }
    }

    /// This replica's share of the rank under `l` (`None`: no share applies: the replica
    /// count is unknown or the rank unlimited).
    pub fn share(&self, l: &Limits) -> Option<u64> {
        share(
            self.limit(l),
            l.replicas,
            l.replica_index,
            self.turn.load(Ordering::Relaxed),
        )
    }

    /// Whether `slots` more fit this replica's share (see [`share`]), holding `own` and
    /// estimating `occupancy`: within the share, or alone on an empty rank when the request
    /// is larger than a share of at least one slot (waiting would not help).
    fn share_fits(&self, l: &Limits, own: u64, occupancy: u64, slots: u64) -> bool {
        match self.share(l) {
            None => true,
            Some(s) => {
                own.saturating_add(slots) <= s || (s > 0 && slots > s && own == 0 && occupancy == 0)
            }
        }
    }

    /// The fresh reservations (taken since the last poll and still held, beyond
    /// refilling this replica's own releases) this replica may hold on the rank under `l`
    /// until the next poll; `None`: no such bound (the replica count is known and shares
    /// apply, the engine's reports do not count, the capacity is unknown, or the rule is
    /// off: `proportional` is only set with the load poll on). Before the first report,
    /// and after a failed poll, the replica counts as alone on the rank (one request,
    /// then doubling per poll), so a replica that starts, or an engine that comes up,
    /// is not filled at once from a count that sees nobody else.
    ///
    /// The rule (the module docs have why): with `free = capacity − busy` at the poll,
    /// a replica that held `own` of the `busy` requests then may take `free × own / busy`
    /// fresh ones (rounded up with the probability of the fraction, by the poll's random
    /// word) but no more than `own` (at most doubling per poll), and one that held none
    /// there may take one (if `free > 0`). Over `R` replicas that saw the same poll, the
    /// parts add up to `free` (plus at most one per replica, from rounding or from
    /// holding none).
    pub fn allowance(&self, l: &Limits) -> Option<u64> {
        if !l.proportional || l.replicas > 0 || !l.learn_from_engine {
            return None;
        }
        let cap = self.limit(l);
        if cap == 0 {
            return None;
        }
        let own = self.own_at_poll.load(Ordering::Relaxed);
        // The others' requests: what the engine reported beyond this replica's own, the
        // more of the last two polls (a request counts at the engine only once it arrives,
        // so one poll may miss the others' newest; a replica alone always sees 0, and
        // with no report, or a failed poll, the last known figure or 0: as if alone,
        // doubling per poll). This replica's whole count comes on top.
        let busy = self.others.load(Ordering::Relaxed).saturating_add(own);
        let free = cap.saturating_sub(busy);
        if own == 0 {
            return Some(free.min(1));
        }
        // busy >= own > 0; u128: no overflow whatever the figures.
        let num = u128::from(free) * u128::from(own);
        let (whole, part) = (num / u128::from(busy), num % u128::from(busy));
        let up = u128::from(self.coin.load(Ordering::Relaxed)) % u128::from(busy) < part;
        let part = u64::try_from(whole).unwrap_or(u64::MAX) + u64::from(up);
        // At most doubling what it held: a replica that saw itself alone may have been
        // only the first to poll.
        Some(part.min(own))
    }

    /// Whether `slots` more fresh reservations fit the [`allowance`](Self::allowance),
    /// holding `new` fresh ones: releases of older reservations made while requests of
    /// this replica waited are refilled freely (the occupancy bounds those; the waiting
    /// request takes the slot at once, before another replica's poll can see it free),
    /// and a replica that holds nothing on the rank and took nothing fresh may send one
    /// request of any size.
    fn allowance_fits(&self, l: &Limits, packed: u64, slots: u64) -> bool {
        let Some(allow) = self.allowance(l) else {
            return true;
        };
        let (own, new) = (packed >> 32, packed & LOW);
        let refill = self.refillable.load(Ordering::Relaxed);
        new.saturating_add(slots) <= allow.saturating_add(refill)
            || (allow > 0 && own == 0 && new == 0)
    }

    /// How long a request holds a slot on this rank, as measured (`None`: nothing measured).
    pub fn hold_time(&self) -> Option<std::time::Duration> {
        let ms = self.hold_ms.load(Ordering::Relaxed);
        (ms > 0).then(|| std::time::Duration::from_millis(ms))
    }

    fn held_for(&self, took: std::time::Duration) {
        let x = u64::try_from(took.as_millis()).unwrap_or(u64::MAX).max(1);
        let _ = self
            .hold_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
                Some(if old == 0 {
                    x
                } else {
                    // An average over about the last 8 (integer steps: never stuck).
                    let (o, n) = (old as i128, x as i128);
                    (o + (n - o) / 8 + (n - o).signum()).max(1) as u64
                })
            });
    }

    /// Whether the engine's last report shows a queue that would hold one more request
    /// for half of the engines' bootstrap timeout or longer: the requests waiting, served
    /// by the running ones a round at a time, each round as long as a request holds a
    /// slot here. Judged only with the engine's reports counting, a waiting figure, and a
    /// hold time measured.
    fn queue_outlasts_bootstrap(&self, l: &Limits) -> bool {
        if !l.learn_from_engine || l.bootstrap_timeout_ms == 0 {
            return false;
        }
        let Some(waiting) = self.engine_waiting.load(Ordering::Relaxed).checked_sub(1) else {
            return false;
        };
        let hold = self.hold_ms.load(Ordering::Relaxed);
        if waiting == 0 || hold == 0 {
            return false;
        }
        let running = self
            .engine_busy
            .load(Ordering::Relaxed)
            .saturating_sub(waiting)
            .max(1);
        let rounds = waiting.saturating_add(1).div_ceil(running);
        rounds.saturating_mul(hold).saturating_mul(2) >= l.bootstrap_timeout_ms
    }

    fn admits(&self, need: &Need, packed: u64) -> bool {
        let occ = self.occupancy_of(packed);
        let cap = self.limit(&need.limits);
        let k = need.slots();
        !self.engine_queues(&need.limits)
            && !self.queue_outlasts_bootstrap(&need.limits)
            && fits(cap, occ, k)
            && self.share_fits(&need.limits, packed >> 32, occ, k)
            && self.kv_fits(need, occ)
            && self.allowance_fits(&need.limits, packed, k)
    }

    /// Whether a request with `need` would be admitted now (no reservation taken).
    pub fn has_room(&self, need: &Need) -> bool {
        self.admits(need, self.reqs.load(Ordering::Acquire))
    }

    /// [`observe_with`](Self::observe_with) with the coin 0 (a fraction of a slot
    /// rounds up).
    pub fn observe(&self, r: &Reported) {
        self.observe_with(r, 0);
    }

    /// Stores one poll's figures and starts a new window (see the module docs). A figure
    /// not reported leaves the capacity as it was and the load at 0. `coin` is a random
    /// word (the poller's) that rounds this replica's proportional part of the free slots.
    pub fn observe_with(&self, r: &Reported, coin: u64) {
        if let Some(cap) = r.max_running.filter(|c| *c > 0) {
            self.engine_cap.store(cap, Ordering::Relaxed);
        }
        self.engine_max_tokens
            .store(r.max_tokens.unwrap_or(0), Ordering::Relaxed);
        self.engine_tokens
            .store(r.tokens.unwrap_or(0), Ordering::Relaxed);
        self.engine_busy
            .store(r.busy.unwrap_or(0), Ordering::Relaxed);
        self.engine_waiting.store(
            r.waiting.map_or(0, |w| w.saturating_add(1)),
            Ordering::Relaxed,
        );
        self.coin.store(coin, Ordering::Relaxed);
        self.engine_prealloc.store(
            r.prealloc.map_or(0, |q| q.saturating_add(1)),
            Ordering::Relaxed,
        );
        self.epoch.fetch_add(1, Ordering::AcqRel);
        let before = match self
            .reqs
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| Some(p & !LOW))
        {
            Ok(p) | Err(p) => p,
        };
        // Requests this replica sent in the window that ended may still be handshaking
        // (in the queue for a few milliseconds on a healthy engine): only a queue longer
        // than they are closes the rank.
        let fresh = before & LOW;
        let own = before >> 32;
        let now = r.busy.map_or(0, |b| b.saturating_sub(own));
        let last = self.others_last.swap(now, Ordering::Relaxed);
        self.own_at_poll.store(own, Ordering::Relaxed);
        self.others.store(now.max(last), Ordering::Relaxed);
        self.engine_queued
            .store(r.prealloc.is_some_and(|q| q > fresh), Ordering::Relaxed);
        self.released_old.store(0, Ordering::Relaxed);
        self.refillable.store(0, Ordering::Relaxed);
        self.new_tokens.store(0, Ordering::Relaxed);
        self.released_old_tokens.store(0, Ordering::Relaxed);
    }

    /// Sets the rank's place in the turn of the remainder slots (see [`share`]).
    pub fn set_turn(&self, turn: u32) {
        self.turn.store(turn, Ordering::Relaxed);
    }

    /// Sets the capacity the engine reported outside a poll (`/server_info`).
    pub fn set_engine_cap(&self, cap: u64) {
        if cap > 0 {
            self.engine_cap.store(cap, Ordering::Relaxed);
        }
    }
}

/// Wakes requests waiting for a decode slot when one may have freed (a reservation
/// released, a poll stored, a worker joined). Shared by the whole pool.
#[derive(Debug, Default)]
pub struct CapacitySignal {
    notify: Notify,
    waiters: AtomicUsize,
    /// Asks the decode load pollers for a poll before their next tick: a request waits
    /// for a decode slot, and a fresh report may give it one (slots other replicas
    /// released, a queue drained, this replica's next proportional part: see
    /// [`RankCapacity::allowance`]).
    poll: Notify,
    /// An early poll is asked for and no poller started one since: asking again costs
    /// one atomic (no lock) until a poller does.
    poll_asked: AtomicBool,
    /// How many early polls were asked for: each poller polls once for every ask it has
    /// not seen.
    poll_asks: AtomicU64,
}

impl CapacitySignal {
    /// Asks for an early poll; asking again before a poller starts one is one atomic.
    pub fn want_poll(&self) {
        if !self.poll_asked.swap(true, Ordering::AcqRel) {
            self.poll_asks.fetch_add(1, Ordering::AcqRel);
            self.poll.notify_waiters();
        }
    }

    /// Resolves when an early poll is asked for after this call (register it before
    /// comparing [`poll_asks`](Self::poll_asks), so no ask is missed).
    pub fn poll_wanted(&self) -> tokio::sync::futures::Notified<'_> {
        self.poll.notified()
    }

    /// A poller starts a poll: the asks so far are answered (the count it has seen).
    pub fn polling(&self) -> u64 {
        self.poll_asked.store(false, Ordering::Release);
        self.poll_asks.load(Ordering::Acquire)
    }

    /// The early polls asked for so far (a poller polls again when this moved past what
    /// [`polling`](Self::polling) returned).
    pub fn poll_asks(&self) -> u64 {
        self.poll_asks.load(Ordering::Acquire)
    }

    /// Wakes every waiter, if any (the check keeps the common release lock-free).
    pub fn wake(&self) {
        if self.waiters.load(Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }

    /// Whether some request waits for a slot now.
    pub fn waiting(&self) -> bool {
        self.waiters.load(Ordering::SeqCst) > 0
    }

    /// Counts the caller as a waiter until the returned guard drops.
    pub fn waiter(self: &Arc<Self>) -> Waiter {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        Waiter(self.clone())
    }
}

/// A request waiting for a decode slot (see [`CapacitySignal::waiter`]).
pub struct Waiter(Arc<CapacitySignal>);

impl Waiter {
    /// A wake-up future; `enable` it before re-checking capacity so no release is missed.
    pub fn notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.0.notify.notified()
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One decode slot held on a (worker, rank) until dropped.
#[derive(Debug)]
pub struct Reservation {
    ranks: Arc<[RankCapacity]>,
    rank: usize,
    epoch: u64,
    tokens: u64,
    slots: u64,
    signal: Arc<CapacitySignal>,
    /// When it was taken, on a rank with a limit (its hold time is measured there only).
    taken: Option<tokio::time::Instant>,
}

impl Reservation {
    /// Takes a slot on `rank` if the rank has room for `need` (one CAS); `None` when it
    /// is full. A rank outside the array (a DP change raced the pick) is not limited.
    pub fn try_take(
        ranks: &Arc<[RankCapacity]>,
        rank: u32,
        need: &Need,
        signal: &Arc<CapacitySignal>,
    ) -> Option<Reservation> {
        let r = ranks.get(rank as usize)?;
        let epoch = r.epoch.load(Ordering::Acquire);
        let k = need.slots().min(LOW >> 1);
        let need = &Need { slots: k, ..*need };
        let mut cur = r.reqs.load(Ordering::Acquire);
        loop {
            if !r.admits(need, cur) {
                return None;
            }
            let next = cur.saturating_add((k << 32) + k);
            match r
                .reqs
                .compare_exchange_weak(cur, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        r.own_tokens.fetch_add(need.tokens, Ordering::Relaxed);
        r.new_tokens.fetch_add(need.tokens, Ordering::Relaxed);
        let taken = (r.limit(&need.limits) > 0).then(tokio::time::Instant::now);
        Some(Reservation {
            taken,
            ranks: ranks.clone(),
            rank: rank as usize,
            epoch,
            tokens: need.tokens,
            slots: k,
            signal: signal.clone(),
        })
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(r) = self.ranks.get(self.rank) {
            if let Some(t) = self.taken {
                r.held_for(t.elapsed());
            }
            let same_window = r.epoch.load(Ordering::Acquire) == self.epoch;
            let _ = r
                .reqs
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| {
                    let (own, new) = (p >> 32, p & LOW);
                    let new = if same_window {
                        new.saturating_sub(self.slots)
                    } else {
                        new
                    };
                    Some((own.saturating_sub(self.slots) << 32) | new)
                });
            sub(&r.own_tokens, self.tokens);
            if same_window {
                sub(&r.new_tokens, self.tokens);
            } else {
                r.released_old.fetch_add(self.slots, Ordering::Relaxed);
                if self.signal.waiting() {
                    r.refillable.fetch_add(self.slots, Ordering::Relaxed);
                }
                r.released_old_tokens
                    .fetch_add(self.tokens, Ordering::Relaxed);
            }
        }
        self.signal.wake();
    }
}

fn sub(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

/// A fresh capacity array for `dp` ranks, whose turns are their DP ranks (until the pool
/// sets them, [`RankCapacity::set_turn`]).
pub fn new_ranks(dp: u32) -> Arc<[RankCapacity]> {
    (0..dp.max(1))
        .map(|rank| RankCapacity {
            turn: AtomicU32::new(rank),
            ..RankCapacity::default()
        })
        .collect()
}

#[cfg(test)]
mod tests;
