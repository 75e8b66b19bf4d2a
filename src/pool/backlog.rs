//! Prefill backlog per (worker, DP rank): how much uncached prompt work the rank has queued,
//! in tokens and in seconds of its own learned pace, and the holds that let the request
//! path bound it (`[admission] prefill_backlog_max_secs`). Engine state, like decode
//! capacity (`super::capacity`): atomics beside the snapshot, shared by every snapshot the
//! worker appears in; the load poller writes what the engine reports, a prefill leg holds
//! its tokens ([`BacklogHold`]) from its send until it ends, and a leg that answered well
//! teaches the rank's pace.
//!
//! Why: a prefill rank computes one batch at a time, so what it has queued is measured in
//! uncached prompt tokens, not requests: a burst of long prompts on one rank keeps each one
//! queued there (while its decode waits, and its bootstrap clock runs) even when another
//! prefill is idle. Bounded in seconds, the excess waits in pdgate's admission queue, where
//! it can still go to whichever prefill frees first.
//!
//! What is learned, per rank ([`Pace`]): its pace in uncached prompt tokens per second, a
//! ratio of two exponentially weighted sums ([`PACE_WEIGHT`]) over the legs that answered:
//! the uncached tokens of each leg (the answer's `prompt_tokens − cached_tokens` when the
//! engine reports them, else pdgate's estimate) and the rank's *service time* for it, the
//! leg's end minus the later of its send and the previous leg's end on the rank. For a rank
//! that computes one prompt at a time that is the leg's own compute (not its wait behind
//! the prompts before it), and a batch that ends together adds its tokens over the batch's
//! time. A leg's time also holds its network and KV hand-off, so the pace errs low; with
//! several replicas sending one rank, others' prompts computed between two of this
//! replica's legs count as this replica's service time, so it errs lower still (the bound
//! then admits less, never more). Also learned: the ratio of a leg's uncached tokens (as
//! the engine counts them) to pdgate's estimate of its prompt (one token per 4 bytes of
//! JSON, no tokenizer), which turns the estimates of the legs in flight into the engine's
//! units and accounts for the rank's prefix-cache hits.
//!
//! The backlog of a rank, in the engine's uncached tokens ([`Figures::tokens`]):
//!
//! ```text
//! backlog = max(engine_waiting + (new − done_old) × ratio, own × ratio)
//! ```
//!
//! - `engine_waiting`: the rank's `num_waiting_uncached_tokens` at the last poll (every
//!   replica's prompts queued for compute); not reported (no poll, a failed one, an engine
//!   without the figure): the backlog is `own × ratio`;
//! - `new`: the estimates of this replica's legs sent since that poll and still running;
//! - `done_old`: those of its legs sent before the poll and ended since;
//! - `own`: every leg this replica has on the rank (a floor, which also counts the prompt
//!   in compute and the computed ones waiting for their decode).
//!
//! In seconds: `backlog ÷ pace`; no pace learned yet: unknown. A model's backlog (the
//! scaling signal) is its ranks' backlogs plus the requests this replica holds in its
//! admission queue because all of them were over the bound ([`HeldBack`]): with the bound
//! on, the excess waits there, and a signal that left it out could never read much more
//! than the bound.
//!
//! The bound ([`BacklogHold::take`]): a rank takes a leg whose own tokens would bring its
//! backlog past `max_secs × pace`, only when it holds none of this replica's legs (so a
//! prompt larger than the whole bound still runs, alone). A rank that has learned no pace
//! yet is held to its pool's (the mean of the learned ones, [`Bound::fallback_pace`]), so a
//! cold rank does not take a whole burst; with no pace learned anywhere nothing is bounded.
//! The check and the count are one compare-and-swap on `own`, so two requests of this
//! replica never both take the last room. With the bound off, a hold only counts.
//!
//! Invariants: lock-free (atomics only, updated once per leg sent and once per leg ended,
//! never per token); a [`BacklogHold`] gives back exactly what it took when dropped,
//! whatever the epoch, and wakes the requests waiting in the admission queue; the arithmetic
//! never panics or divides by zero (floats are checked finite, counts saturate).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use super::CapacitySignal;
use crate::types::DpRank;

/// The weight of the newest leg in the exponentially weighted sums of [`Pace`]: about the
/// last ten legs count.
pub const PACE_WEIGHT: f64 = 0.2;

/// The largest ratio of the engine's uncached tokens to pdgate's estimate that is learned
/// (a tokenizer that packs 4 bytes into far more than one token is not a real one).
const MAX_RATIO: f64 = 16.0;

/// A rank's learned pace: exponentially weighted sums of the uncached tokens its legs
/// computed and of the service time they took (see the module docs). Packed in one word
/// (two `f32`s) so a reader never sees half an update.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pace {
    pub tokens: f32,
    pub secs: f32,
}

impl Pace {
    fn pack(self) -> u64 {
        (u64::from(self.tokens.to_bits()) << 32) | u64::from(self.secs.to_bits())
    }

    fn unpack(w: u64) -> Pace {
        Pace {
            tokens: f32::from_bits((w >> 32) as u32),
            secs: f32::from_bits(w as u32),
        }
    }

    /// The pace after one more leg of `tokens` uncached tokens served in `secs`. The first
    /// leg is taken as it is; a sample that is not a finite non-negative pair is ignored.
    pub fn sample(self, tokens: f64, secs: f64) -> Pace {
        let ok = |v: f64| v.is_finite() && v >= 0.0;
        if !ok(tokens) || !ok(secs) {
            return self;
        }
        let (t, s) = (tokens as f32, secs as f32);
        if self == Pace::default() {
            return Pace { tokens: t, secs: s };
        }
        let w = PACE_WEIGHT as f32;
        Pace {
            tokens: self.tokens + w * (t - self.tokens),
            secs: self.secs + w * (s - self.secs),
        }
    }

    /// Uncached tokens per second, once a leg took measurable time.
    pub fn per_sec(self) -> Option<f64> {
        let (t, s) = (f64::from(self.tokens), f64::from(self.secs));
        (s > 0.0 && t > 0.0 && t.is_finite() && s.is_finite()).then(|| t / s)
    }
}

/// One rank's figures as read at one moment (see the module docs for each).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    pub engine_waiting: Option<u64>,
    pub new: u64,
    pub done_old: u64,
    pub own: u64,
    /// The engine's uncached tokens per estimated token.
    pub ratio: f64,
    pub pace: Option<f64>,
}

impl Figures {
    /// The backlog in the engine's uncached tokens.
    pub fn tokens(&self) -> f64 {
        let r = self.ratio;
        let own = self.own as f64 * r;
        match self.engine_waiting {
            Some(w) => (w as f64 + (self.new as f64 - self.done_old as f64) * r).max(own),
            None => own,
        }
    }

    /// The backlog in seconds of the rank's pace (`None`: no pace learned).
    pub fn secs(&self) -> Option<f64> {
        self.pace.map(|p| self.tokens() / p)
    }

    /// Whether a leg of `est` estimated tokens may join, under a bound of `max_secs`
    /// (0: none): a rank holding none of this replica's legs, or without a pace, always
    /// takes it.
    pub fn admits(&self, est: u64, max_secs: f64) -> bool {
        let Some(pace) = self.pace else {
            return true;
        };
        if self.own == 0 || max_secs <= 0.0 {
            return true;
        }
        self.tokens() + est as f64 * self.ratio <= max_secs * pace
    }
}

/// The bound a leg is held to: `max_secs` of backlog (0: none), in the rank's own pace,
/// or `fallback_pace` while the rank has learned none (its pool's, so that a rank no leg
/// has answered on yet does not take a whole burst; none anywhere: no bound).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Bound {
    pub max_secs: f64,
    pub fallback_pace: Option<f64>,
}

impl Bound {
    /// Whether a rank with `f` takes a leg of `est` estimated tokens.
    pub fn admits(&self, f: Figures, est: u64) -> bool {
        Figures {
            pace: f.pace.or(self.fallback_pace),
            ..f
        }
        .admits(est, self.max_secs)
    }
}

/// One prefill DP rank's backlog state.
#[derive(Debug, Default)]
pub struct RankBacklog {
    /// `num_waiting_uncached_tokens` at the last poll, plus one (0 = not reported).
    engine_waiting: AtomicU64,
    /// Bumped at every poll.
    epoch: AtomicU64,
    /// Estimated tokens of this replica's legs on the rank.
    own: AtomicU64,
    /// Of those, the ones sent since the last poll.
    new: AtomicU64,
    /// Estimated tokens of legs sent before the last poll and ended since.
    done_old: AtomicU64,
    /// [`Pace`], packed (0 = nothing learned).
    pace: AtomicU64,
    /// The learned ratio plus one, as `f32` bits (0 = nothing learned: 1).
    ratio: AtomicU32,
    /// When the last leg that taught the pace ended (a `progress::stamp`, 0 = never).
    last_done: AtomicU64,
    /// Estimated tokens of requests this replica holds in its admission queue because every
    /// prefill rank of their model was over the bound, counted on one rank of that model
    /// ([`HeldBack`]): part of the model's backlog (`pdgate_prefill_backlog_seconds`), never
    /// of a rank's, nor of the bound's check.
    held_back: AtomicU64,
}

impl RankBacklog {
    /// The figures now (relaxed reads: a rank's figures move as legs come and go).
    pub fn figures(&self) -> Figures {
        Figures {
            engine_waiting: self.engine_waiting.load(Ordering::Relaxed).checked_sub(1),
            new: self.new.load(Ordering::Relaxed),
            done_old: self.done_old.load(Ordering::Relaxed),
            own: self.own.load(Ordering::Acquire),
            ratio: self.ratio(),
            pace: self.pace(),
        }
    }

    /// The requests held back in pdgate's queue and counted here ([`HeldBack`]), in the
    /// engine's uncached tokens.
    pub fn held_back(&self) -> f64 {
        self.held_back.load(Ordering::Relaxed) as f64 * self.ratio()
    }

    /// The learned pace in uncached tokens per second.
    pub fn pace(&self) -> Option<f64> {
        Pace::unpack(self.pace.load(Ordering::Relaxed)).per_sec()
    }

    /// The engine's uncached tokens per estimated token (1 until learned).
    pub fn ratio(&self) -> f64 {
        match self.ratio.load(Ordering::Relaxed) {
            0 => 1.0,
            bits => (f64::from(f32::from_bits(bits)) - 1.0).clamp(0.0, MAX_RATIO),
        }
    }

    /// Stores one poll's figure (`None`: not reported, or the poll failed) and starts a
    /// new window.
    pub fn observe(&self, waiting: Option<u64>) {
        self.engine_waiting.store(
            waiting.map_or(0, |w| w.saturating_add(1)),
            Ordering::Relaxed,
        );
        self.epoch.fetch_add(1, Ordering::AcqRel);
        self.new.store(0, Ordering::Relaxed);
        self.done_old.store(0, Ordering::Relaxed);
    }

    /// A leg of `est` estimated tokens, sent at stamp `started`, answered at `done`;
    /// `answer`: the engine's `(prompt_tokens, cached_tokens)` for it, when it reported
    /// them for this one prompt.
    pub fn learn(&self, est: u64, started: u64, done: u64, answer: Option<(u64, u64)>) {
        let prev = self.last_done.fetch_max(done, Ordering::AcqRel);
        let secs = done.saturating_sub(started.max(prev)) as f64 / 1e6;
        let uncached = match answer {
            Some((prompt, cached)) if prompt > 0 => {
                let u = prompt.saturating_sub(cached);
                if est > 0 {
                    let sample = (u as f64 / est as f64).min(MAX_RATIO);
                    let known = self.ratio.load(Ordering::Relaxed) != 0;
                    let next = if known {
                        let r = self.ratio();
                        r + PACE_WEIGHT * (sample - r)
                    } else {
                        sample
                    };
                    self.ratio
                        .store(((next + 1.0) as f32).to_bits(), Ordering::Relaxed);
                }
                u as f64
            }
            _ => est as f64 * self.ratio(),
        };
        let _ = self
            .pace
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some(Pace::unpack(w).sample(uncached, secs).pack())
            });
    }
}

/// A fresh backlog array for `dp` ranks.
pub fn new_ranks(dp: u32) -> Arc<[RankBacklog]> {
    (0..dp.max(1)).map(|_| RankBacklog::default()).collect()
}

/// One prefill leg's tokens counted on its (worker, rank) until dropped (the leg ended:
/// answered, failed or cancelled).
#[derive(Debug)]
pub struct BacklogHold {
    ranks: Arc<[RankBacklog]>,
    rank: usize,
    epoch: u64,
    tokens: u64,
    /// The request is one prompt: the answer's figures are its.
    single: bool,
    signal: Arc<CapacitySignal>,
}

impl BacklogHold {
    /// Counts a leg of `est` estimated tokens (`single`: one prompt instance) on `rank`,
    /// unless the rank is over `bound` with it (see [`Bound`] and the module docs); one
    /// CAS. A rank outside the array (a DP change raced the pick) is not bounded and counts
    /// nothing.
    pub fn take(
        ranks: &Arc<[RankBacklog]>,
        rank: DpRank,
        est: u64,
        single: bool,
        bound: &Bound,
        signal: &Arc<CapacitySignal>,
    ) -> Option<BacklogHold> {
        let hold = |rank, epoch, tokens| BacklogHold {
            ranks: ranks.clone(),
            rank,
            epoch,
            tokens,
            single,
            signal: signal.clone(),
        };
        let Some(r) = ranks.get(rank as usize) else {
            return Some(hold(usize::MAX, 0, 0));
        };
        let epoch = r.epoch.load(Ordering::Acquire);
        let mut own = r.own.load(Ordering::Acquire);
        loop {
            let now = Figures { own, ..r.figures() };
            if bound.max_secs > 0.0 && !bound.admits(now, est) {
                return None;
            }
            match r.own.compare_exchange_weak(
                own,
                own.saturating_add(est),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => own = now,
            }
        }
        r.new.fetch_add(est, Ordering::Relaxed);
        Some(hold(rank as usize, epoch, est))
    }

    /// The leg answered well at stamp `done`, sent at `started`, its answer's prompt-cache
    /// figures `answer` (`prompt_tokens`, `cached_tokens`, if reported): the rank learns
    /// from it, then the hold ends.
    pub fn answered(self, started: u64, done: u64, answer: Option<(u64, u64)>) {
        if let Some(r) = self.ranks.get(self.rank) {
            r.learn(self.tokens, started, done, answer.filter(|_| self.single));
        }
    }
}

impl Drop for BacklogHold {
    fn drop(&mut self) {
        if let Some(r) = self.ranks.get(self.rank) {
            sub(&r.own, self.tokens);
            if r.epoch.load(Ordering::Acquire) == self.epoch {
                sub(&r.new, self.tokens);
            } else {
                r.done_old.fetch_add(self.tokens, Ordering::Relaxed);
            }
        }
        self.signal.wake();
    }
}

/// A request's tokens counted as held back on a rank of its model while it waits in the
/// admission queue for a prefill rank under the bound; given back when dropped (it was
/// admitted, waits for something else, or ended).
#[derive(Debug)]
pub struct HeldBack {
    ranks: Arc<[RankBacklog]>,
    tokens: u64,
}

impl HeldBack {
    /// Counts `est` estimated tokens on the first rank of `ranks`.
    pub fn new(ranks: &Arc<[RankBacklog]>, est: u64) -> HeldBack {
        if let Some(r) = ranks.first() {
            r.held_back.fetch_add(est, Ordering::Relaxed);
        }
        HeldBack {
            ranks: ranks.clone(),
            tokens: est,
        }
    }
}

impl Drop for HeldBack {
    fn drop(&mut self) {
        if let Some(r) = self.ranks.first() {
            sub(&r.held_back, self.tokens);
        }
    }
}

fn sub(a: &AtomicU64, n: u64) {
    let _ = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(n))
    });
}

#[cfg(test)]
mod tests;
