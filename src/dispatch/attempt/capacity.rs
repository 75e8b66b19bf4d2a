//! Decode capacity on the request path: what a request needs of a decode rank, and its
//! wait in the admission queue while every eligible decode rank is full (or every prefill
//! rank is over its backlog bound: `super::backlog`, the same queue and wake-ups).
//!
//! Neither leg is sent before a slot is reserved on the decode rank
//! (`pool::capacity::Reservation`, one CAS), and the slot is held by the decode leg's
//! load guard until the response body ends. When no rank has room, the request joins the
//! admission queue (its bound, `admission.max_queue`, and its deadline,
//! `admission.queue_timeout_ms`), and waits for the pool's capacity signal — a released
//! slot, a load poll, a worker joining — never polling. A full queue answers 429, an
//! expired wait 503, both with `Retry-After` (`FailReason::Overloaded`,
//! `FailReason::QueueTimeout`). The request keeps its place in the queue across the
//! wake-ups of one attempt, and leaves it as soon as it holds a slot.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::AttemptFailure;
use super::{Dispatcher, ReqCtx};
use crate::admission::Queued;
use crate::config::{AdmissionConfig, CapacityConfig};
use crate::error::{FailReason, Failure};
use crate::pool::capacity::{Limits, Need, Waiter};
use crate::pool::replicas::Count;
use crate::pool::Snapshot;
use crate::request::ParsedRequest;
use crate::telemetry;
use crate::types::{Role, WorkerId};

const FULL: &str = "every eligible decode rank is at capacity";

/// What `req` needs of a decode rank under the `[capacity]` settings `c`, the
/// replica-wide `[admission]` settings `a` (the engines' bootstrap timeout), whether the
/// engines' load is polled (`polled`: proportional admission needs it) and the replica
/// count `r` behind the shares (`pool::replicas`: static or from discovery, read once per
/// request).
pub(in crate::dispatch) fn need(
    c: &CapacityConfig,
    a: &AdmissionConfig,
    polled: bool,
    r: Count,
    req: &ParsedRequest,
) -> Need {
    let limits = Limits {
        replicas: r.replicas,
        replica_index: r.index,
        proportional: c.proportional_share && polled,
        ..Limits::from_config(c, a)
    };
    Need {
        limits,
        tokens: req.kv_tokens_estimate(),
        slots: req.instances() as u64,
    }
}

/// The failure a pick reports when decodes exist but none has room (an internal marker:
/// the attempt waits on it, and it reaches a client only if nothing can wait).
pub(in crate::dispatch) fn full_failure() -> AttemptFailure {
    AttemptFailure::unblamed(Failure::new(FailReason::Overloaded, FULL))
}

/// Whether a pick failed only because every decode rank is full, or every prefill rank is
/// over its backlog bound (`super::backlog`): the request can wait in the queue for either.
pub(in crate::dispatch) fn is_full(af: &AttemptFailure) -> bool {
    af.blame.is_none()
        && af.failure.reason == FailReason::Overloaded
        && (af.failure.message == FULL || af.failure.message == super::backlog::OVER)
}

/// Whether a pick failed because every decode rank is full (not a prefill backlog).
pub(in crate::dispatch) fn decode_full(af: &AttemptFailure) -> bool {
    af.failure.message == FULL
}

/// What a request waiting after `full` waits for (the end of a queue timeout's message).
pub(in crate::dispatch) fn waiting_for(full: &AttemptFailure) -> &'static str {
    if full.failure.message == super::backlog::OVER {
        "no prefill rank under admission.prefill_backlog_max_secs"
    } else {
        "no decode slot"
    }
}

/// Whether some routable decode (among `among`, else all) is not excluded (so a failed
/// pick means "full").
pub(in crate::dispatch) fn any_routable(
    snap: &Snapshot,
    among: Option<&[crate::pool::Routable]>,
    exclude: &[WorkerId],
) -> bool {
    among
        .unwrap_or_else(|| snap.routable(Role::Decode))
        .iter()
        .any(|r| !exclude.contains(&r.worker))
}

/// A request's place in the admission queue while it waits for a decode slot, counted
/// per model for autoscalers: `pdgate_admission_queue_waiting{model}` while it waits, and
/// its wait in `pdgate_admission_queue_wait_seconds{model, outcome}` when it ends
/// (admitted, timeout, gone).
pub(in crate::dispatch) struct Queue<'a> {
    queued: Queued<'a>,
    waiter: Waiter,
    model: String,
    waiting: metrics::Gauge,
    since: tokio::time::Instant,
    timed_out: AtomicBool,
    admitted: bool,
}

/// The pace at which the decode ranks a request may go to free slots, in requests a
/// second: each rank's capacity over the time a request holds a slot there, summed over
/// the routable decodes of `model` (all without one). `None` when no rank has both a
/// capacity and a measured hold time (nothing to estimate from).
pub(in crate::dispatch) fn drain_rate(
    snap: &Snapshot,
    model: Option<&str>,
    need: &Need,
) -> Option<f64> {
    let mut rate = 0.0;
    for r in snap.routable_for(Role::Decode, model) {
        let Some(w) = snap.worker(Role::Decode, r.worker) else {
            continue;
        };
        for rank in w.per_rank.capacity.iter() {
            let cap = rank.limit(&need.limits);
            if let (true, Some(hold)) = (cap > 0, rank.hold_time()) {
                rate += cap as f64 / hold.as_secs_f64().max(1e-3);
            }
        }
    }
    (rate > 0.0).then_some(rate)
}

/// How long a request that joins a queue of `ahead` waiting requests would wait, when
/// slots free at `rate` a second.
pub(in crate::dispatch) fn estimated_wait(ahead: usize, rate: f64) -> Duration {
    Duration::from_secs_f64(((ahead as f64 + 1.0) / rate).min(1e6))
}

impl<'a> Queue<'a> {
    /// Joins the queue; a full queue (or no queue) answers 429, and a request whose
    /// estimated wait ([`estimated_wait`] at the pool's [`drain_rate`]) is longer than the
    /// queue timeout answers 503 at once, with the estimate in `Retry-After`, instead of
    /// waiting for a timeout it cannot beat. `model`: the request's model (`None`: any,
    /// then the pool's one model names the wait, or "" among several).
    pub(in crate::dispatch) fn join(
        d: &Dispatcher,
        ctx: &'a ReqCtx,
        full: AttemptFailure,
        snap: &Snapshot,
        model: Option<&str>,
        need: &Need,
    ) -> Result<Queue<'a>, AttemptFailure> {
        let Some(adm) = ctx.queue.as_deref() else {
            return Err(full);
        };
        // The estimate is of the decode slots' pace: a wait for a prefill rank under its
        // backlog bound is not estimated (it ends as prefill legs end).
        if decode_full(&full) {
            if let Some(rate) = drain_rate(snap, model, need) {
                let wait = estimated_wait(adm.waiting(), rate);
                if wait > adm.queue_timeout() {
                    return Err(AttemptFailure::unblamed(adm.refuse_on_estimate(FULL, wait)));
                }
            }
        }
        let queued = adm
            .enqueue(&full.failure.message)
            .map_err(AttemptFailure::unblamed)?;
        let model = match model {
            Some(m) => m.to_string(),
            None => match d.pool.load().models.as_slice() {
                [one] => one.name.to_string(),
                _ => String::new(),
            },
        };
        let waiting = metrics::gauge!(telemetry::ADMISSION_QUEUE_WAITING, "model" => model.clone());
        waiting.increment(1.0);
        Ok(Queue {
            queued,
            waiter: d.pool.capacity_signal().waiter(),
            model,
            waiting,
            since: tokio::time::Instant::now(),
            timed_out: AtomicBool::new(false),
            admitted: false,
        })
    }

    /// A wake-up; enable it before looking at capacity again.
    pub(in crate::dispatch) fn wake(&self) -> Pin<Box<tokio::sync::futures::Notified<'_>>> {
        Box::pin(self.waiter.notified())
    }

    /// Waits for `wake` under the queue's deadline (`what`: what the request waits for,
    /// named if the wait times out).
    pub(in crate::dispatch) async fn wait(
        &self,
        wake: Pin<Box<tokio::sync::futures::Notified<'_>>>,
        what: &str,
    ) -> Result<(), Failure> {
        let r = self.queued.wait(wake, what).await;
        if r.is_err() {
            self.timed_out.store(true, Ordering::Relaxed);
        }
        r
    }

    /// The wait ended with a slot: the request leaves the queue now (not when its
    /// attempt ends).
    pub(in crate::dispatch) fn admitted(mut self) {
        self.admitted = true;
    }
}

impl Drop for Queue<'_> {
    fn drop(&mut self) {
        self.waiting.decrement(1.0);
        let outcome = if self.admitted {
            "admitted"
        } else if self.timed_out.load(Ordering::Relaxed) {
            "timeout"
        } else {
            "gone"
        };
        metrics::histogram!(
            telemetry::ADMISSION_QUEUE_WAIT,
            "model" => std::mem::take(&mut self.model),
            "outcome" => outcome
        )
        .record(self.since.elapsed().as_secs_f64());
    }
}
