//! Admission: at most `max_in_flight` requests are served at once; up to `max_queue` more
//! wait (each at most `queue_timeout`) for a slot. A full queue answers 429 and a wait that
//! times out answers 503, both with `Retry-After`.
//!
//! Invariant: a slot is held until the response body ends (or is dropped), so a long
//! stream counts for its whole life, and past it by a prefill leg still answering (see
//! `relay::body`): the slot travels with the request. The fast path is one atomic
//! (`try_acquire`).
//!
//! Its own module (not the front door's) because both the front door (which admits) and
//! `dispatch` and `relay` (whose response body and detached legs hold the slot) use it.
//!
//! A reload changes the limits in place ([`Admission::reconfigure`]): a higher
//! `max_in_flight` adds permits at once; a lower one takes free permits away at once and the
//! rest as requests in flight end, so the cap is never exceeded after the change settles
//! and nobody in flight is cut. Switching between no limit (0) and a limit swaps the
//! semaphore: requests admitted before keep their old slot.
//!
//! The same queue (its bound and its timeout) holds requests waiting for a decode slot
//! (`pool::capacity`): [`Admission::enqueue`] counts such a request in the queue without
//! a semaphore, and `dispatch` waits on the pool's capacity signal under the returned
//! [`Queued`]'s deadline.
//!
//! The byte budget (`crate::memory`, `admission.max_bytes_in_flight`) is admission's too:
//! [`Admission::charge`] grows a request's charge and maps a refusal to its answer (413 when
//! it can never fit, 503 with `Retry-After` when the budget is full now); the body's charge
//! rides on the [`Slot`], so it ends with the response body like the slot itself.
//!
//! A model with its own limits (`[models.settings."NAME".admission]`) has an admission of
//! its own ([`Admission::for_model`], held by the dispatcher): a request of that model takes
//! a slot there too once its model is known, held inside its replica-wide [`Slot`]
//! ([`Slot::hold_model`]) so that both end together. Its series carry a `model` label
//! (`pdgate_model_*`); its byte budget is never charged (bytes stay replica-wide).
//!
//! Gauges (handles registered once): `pdgate_in_flight_requests` counts the PD requests
//! admitted whose response has not ended (also when `max_in_flight` is 0, i.e. no limit),
//! `pdgate_admission_queue` those waiting for a slot. Both are moved by drop guards, so
//! every way a request ends (answer, error, client gone) brings them back: at rest both are
//! 0, which the chaos soak checks.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use arc_swap::ArcSwapOption;
use std::sync::Arc;
use std::time::Duration;

use metrics::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::AdmissionConfig;
use crate::error::{FailReason, Failure};
use crate::memory::{ByteBudget, Charge, Refusal};
use crate::telemetry;

pub struct Admission {
    slots: ArcSwapOption<Semaphore>,
    /// The permits the current semaphore stands for (`max_in_flight`).
    limit: AtomicUsize,
    waiting: AtomicUsize,
    max_queue: AtomicUsize,
    timeout_ms: AtomicU64,
    in_flight: Gauge,
    queued: Gauge,
    bytes: Arc<ByteBudget>,
    /// The model whose own limits these are (`[models.settings."NAME".admission]`);
    /// `None` for the replica-wide admission.
    model: Option<Arc<str>>,
}

/// Decrements the wait count (and the queue gauge) however the wait ends.
struct Waiting<'a>(&'a AtomicUsize, &'a Gauge);
impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.decrement(1.0);
    }
}

/// One admitted request: its slot (none without a limit), its count in
/// `pdgate_in_flight_requests` and, with client keys, its count against its key's limit;
/// all given back when dropped.
pub struct Slot {
    _permit: Option<OwnedSemaphorePermit>,
    _client: Option<ClientHold>,
    /// The request's slot in its model's own admission, when its model has one.
    _model: Option<Box<Slot>>,
    /// The bytes the request holds (its body, buffered answers), given back with the slot.
    bytes: Charge,
    in_flight: Gauge,
}

impl Slot {
    fn new(permit: Option<OwnedSemaphorePermit>, in_flight: &Gauge) -> Slot {
        in_flight.increment(1.0);
        Slot {
            _permit: permit,
            _client: None,
            _model: None,
            bytes: Charge::none(),
            in_flight: in_flight.clone(),
        }
    }

    /// The slot also holds `charge` (given back when the slot is).
    pub fn hold_bytes(&mut self, charge: Charge) {
        self.bytes.absorb(charge);
    }

    /// The slot also holds `model`, the request's slot in its model's own admission (so
    /// that both end together).
    pub fn hold_model(&mut self, model: Slot) {
        self._model = Some(Box::new(model));
    }

    /// The slot, also holding the request's count against its client's limit (so that
    /// both end together, with the response body or a prefill leg left running).
    pub fn with_client(mut self, hold: Option<ClientHold>) -> Slot {
        self._client = hold;
        self
    }
}

/// One request counted against a per-client limit (its API key's requests in flight):
/// taken with one atomic add, given back when dropped. Lock-free, and without a wait: a
/// client over its limit is answered 429 at once.
#[derive(Debug)]
pub struct ClientHold(Arc<AtomicUsize>);

impl ClientHold {
    /// Counts one more request on `counter`, unless `max` are in flight already.
    pub fn try_take(counter: &Arc<AtomicUsize>, max: usize) -> Option<ClientHold> {
        let before = counter.fetch_add(1, Ordering::AcqRel);
        if before >= max {
            counter.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(ClientHold(counter.clone()))
    }
}

impl Drop for ClientHold {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.in_flight.decrement(1.0);
    }
}

impl Admission {
    pub fn new(cfg: &AdmissionConfig) -> Admission {
        Admission {
            slots: ArcSwapOption::new(
                (cfg.max_in_flight > 0).then(|| Arc::new(Semaphore::new(cfg.max_in_flight))),
            ),
            limit: AtomicUsize::new(cfg.max_in_flight),
            waiting: AtomicUsize::new(0),
            max_queue: AtomicUsize::new(cfg.max_queue),
            timeout_ms: AtomicU64::new(cfg.queue_timeout_ms),
            in_flight: metrics::gauge!(telemetry::IN_FLIGHT),
            queued: metrics::gauge!(telemetry::ADMISSION_QUEUE),
            bytes: ByteBudget::new(cfg.max_bytes_in_flight),
            model: None,
        }
    }

    /// One model's own admission: its in-flight cap and wait queue (`max_in_flight`,
    /// `max_queue`, `queue_timeout_ms` of `cfg`), counted in the `model`-labelled series.
    /// The byte budget stays the replica-wide admission's: this one's is never charged.
    pub fn for_model(cfg: &AdmissionConfig, model: &str) -> Admission {
        let label = model.to_string();
        Admission {
            in_flight: metrics::gauge!(telemetry::MODEL_IN_FLIGHT, "model" => label.clone()),
            queued: metrics::gauge!(telemetry::MODEL_ADMISSION_QUEUE, "model" => label),
            model: Some(Arc::from(model)),
            ..Admission::new(cfg)
        }
    }

    /// Counts a request shed for `reason` (under its model, for a model's admission).
    fn rejected(&self, reason: &'static str) {
        match &self.model {
            None => metrics::counter!(telemetry::ADMISSION_REJECTED, "reason" => reason),
            Some(m) => metrics::counter!(
                telemetry::MODEL_ADMISSION_REJECTED,
                "model" => m.to_string(),
                "reason" => reason
            ),
        }
        .increment(1);
    }

    /// " for this model" for a model's admission (the model is not named: the client
    /// knows which it asked for).
    fn whose(&self) -> &'static str {
        if self.model.is_some() {
            " for this model"
        } else {
            ""
        }
    }

    /// The in-flight byte budget.
    pub fn bytes(&self) -> &Arc<ByteBudget> {
        &self.bytes
    }

    /// Grows `charge` by `n` bytes of `what` (a body, an answer), or the failure to answer
    /// with: 413 when it could never fit, 503 with `Retry-After` when the budget is full.
    pub fn charge(charge: &mut Charge, n: usize, what: &str) -> Result<(), Failure> {
        charge.grow(n).map_err(|r| refused(r, what))
    }

    /// Applies reloaded limits (see the module docs).
    pub fn reconfigure(&self, cfg: &AdmissionConfig) {
        self.bytes.set_limit(cfg.max_bytes_in_flight);
        self.max_queue.store(cfg.max_queue, Ordering::Relaxed);
        self.timeout_ms
            .store(cfg.queue_timeout_ms, Ordering::Relaxed);
        let old = self.limit.swap(cfg.max_in_flight, Ordering::AcqRel);
        let new = cfg.max_in_flight;
        match (old, new, self.slots.load_full()) {
            _ if old == new => {}
            (_, 0, _) => self.slots.store(None),
            (_, _, None) => self.slots.store(Some(Arc::new(Semaphore::new(new)))),
            (_, _, Some(sem)) if new > old => sem.add_permits(new - old),
            (_, _, Some(sem)) => {
                // Free permits go at once; the rest are taken as they come back.
                let missing = (old - new).saturating_sub(sem.forget_permits(old - new));
                if let Ok(n) = u32::try_from(missing) {
                    if n > 0 {
                        tokio::spawn(async move {
                            if let Ok(p) = sem.acquire_many_owned(n).await {
                                p.forget();
                            }
                        });
                    }
                }
            }
        }
        tracing::info!(
            model = self.model.as_deref().unwrap_or("*"),
            max_in_flight = new,
            max_queue = cfg.max_queue,
            queue_timeout_ms = cfg.queue_timeout_ms,
            "admission limits"
        );
    }

    /// A slot for one request, or the failure to answer with.
    pub async fn admit(&self) -> Result<Slot, Failure> {
        let slots = {
            let current = self.slots.load();
            let Some(slots) = current.as_ref() else {
                return Ok(Slot::new(None, &self.in_flight));
            };
            if let Ok(p) = Arc::clone(slots).try_acquire_owned() {
                return Ok(Slot::new(Some(p), &self.in_flight));
            }
            Arc::clone(slots)
        };
        let max_queue = self.max_queue.load(Ordering::Relaxed);
        let timeout = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= max_queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            self.rejected("queue_full");
            return Err(Failure::new(
                FailReason::Overloaded,
                format!(
                    "too many requests in flight{} and the wait queue is full",
                    self.whose()
                ),
            ));
        }
        self.queued.increment(1.0);
        let _w = Waiting(&self.waiting, &self.queued);
        match tokio::time::timeout(timeout, slots.acquire_owned()).await {
            Ok(Ok(p)) => Ok(Slot::new(Some(p), &self.in_flight)),
            Ok(Err(_)) => Err(Failure::new(FailReason::Internal, "admission closed")),
            Err(_) => {
                self.rejected("queue_timeout");
                Err(Failure::new(
                    FailReason::QueueTimeout,
                    format!(
                        "no slot{} within the queue timeout of {} ms",
                        self.whose(),
                        timeout.as_millis()
                    ),
                ))
            }
        }
    }
}

/// A refused charge as the failure to answer with (counted in
/// `pdgate_admission_rejected_total`).
pub fn refused(r: Refusal, what: &str) -> Failure {
    let (label, reason, msg) = match r {
        Refusal::Never { wanted, limit } => (
            "bytes_too_large",
            FailReason::PayloadTooLarge,
            format!("{what} needs {wanted} bytes, more than the whole in-flight byte budget of {limit} bytes (admission.max_bytes_in_flight)"),
        ),
        Refusal::Full { wanted, limit } => (
            "bytes_full",
            FailReason::MemoryFull,
            format!("{what} needs {wanted} bytes and the in-flight byte budget of {limit} bytes (admission.max_bytes_in_flight) is full; retry later"),
        ),
    };
    metrics::counter!(telemetry::ADMISSION_REJECTED, "reason" => label).increment(1);
    Failure::new(reason, msg)
}

/// A request counted in the wait queue for something other than the in-flight cap (a
/// decode slot), from [`Admission::enqueue`]; leaves the queue when dropped.
pub struct Queued<'a> {
    _w: Waiting<'a>,
    deadline: tokio::time::Instant,
    timeout: Duration,
}

impl Queued<'_> {
    /// Waits for `wake` until the queue deadline (from joining the queue); a timeout
    /// answers 503 with `Retry-After`, like a wait for the in-flight cap.
    pub async fn wait<F: std::future::Future>(&self, wake: F, what: &str) -> Result<(), Failure> {
        match tokio::time::timeout_at(self.deadline, wake).await {
            Ok(_) => Ok(()),
            Err(_) => {
                metrics::counter!(telemetry::ADMISSION_REJECTED, "reason" => "capacity_timeout")
                    .increment(1);
                Err(Failure::new(
                    FailReason::QueueTimeout,
                    format!(
                        "{what} within the queue timeout of {} ms",
                        self.timeout.as_millis()
                    ),
                ))
            }
        }
    }
}

impl Admission {
    /// Requests waiting in the queue now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// The answer to a request whose estimated wait (`wait`, for `what`) is longer than
    /// the queue timeout: 503 now, with the estimate in `Retry-After`, counted as
    /// `capacity_wait_estimate`.
    pub fn refuse_on_estimate(&self, what: &str, wait: Duration) -> Failure {
        metrics::counter!(telemetry::ADMISSION_REJECTED, "reason" => "capacity_wait_estimate")
            .increment(1);
        let secs = u32::try_from(wait.as_secs().saturating_add(1)).unwrap_or(u32::MAX);
        Failure::new(
            FailReason::QueueTimeout,
            format!(
                "{what}: the estimated wait of {:.1} s (requests waiting, against the pace decode slots free) is longer than the queue timeout of {} ms",
                wait.as_secs_f64(),
                self.queue_timeout().as_millis()
            ),
        )
        .retry_after(secs)
    }

    /// The longest wait in the queue (`queue_timeout_ms`).
    pub fn queue_timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed))
    }

    /// Joins the wait queue (bounded by `max_queue`, with `queue_timeout_ms` from now)
    /// without a slot to wait for; a full queue answers 429 with `Retry-After`.
    pub fn enqueue(&self, what: &str) -> Result<Queued<'_>, Failure> {
        let max_queue = self.max_queue.load(Ordering::Relaxed);
        let timeout = Duration::from_millis(self.timeout_ms.load(Ordering::Relaxed));
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= max_queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!(telemetry::ADMISSION_REJECTED, "reason" => "capacity_queue_full")
                .increment(1);
            return Err(Failure::new(
                FailReason::Overloaded,
                format!("{what} and the wait queue is full"),
            ));
        }
        self.queued.increment(1.0);
        Ok(Queued {
            _w: Waiting(&self.waiting, &self.queued),
            deadline: tokio::time::Instant::now() + timeout,
            timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(max_in_flight: usize) -> AdmissionConfig {
        AdmissionConfig {
            max_in_flight,
            max_queue: 0,
            ..AdmissionConfig::default()
        }
    }

    /// Admits until refused (bounded); returns the slots taken.
    async fn fill(a: &Admission) -> Vec<Slot> {
        let mut held = Vec::new();
        for _ in 0..64 {
            match a.admit().await {
                Ok(s) => held.push(s),
                Err(_) => break,
            }
        }
        held
    }

    #[tokio::test]
    async fn limits_change_in_place() {
        // (start, reloaded, slots held across the reload, admitted after all are back)
        let cases = [
            (2, 4, 2, 4),
            (4, 1, 3, 1),
            (3, 1, 0, 1),
            (0, 2, 5, 2),
            (2, 0, 2, 64),
        ];
        for (from, to, hold, after) in cases {
            let a = Admission::new(&cfg(from));
            let held: Vec<Slot> = fill(&a).await.into_iter().take(hold).collect();
            a.reconfigure(&cfg(to));
            drop(held);
            // Let the task that takes back permits still in use run.
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
            assert_eq!(fill(&a).await.len(), after, "{from} -> {to} holding {hold}");
        }
    }

    #[test]
    fn a_client_hold_counts_until_dropped_and_refuses_past_the_limit() {
        let c = Arc::new(AtomicUsize::new(0));
        let a = ClientHold::try_take(&c, 2).expect("first");
        let b = ClientHold::try_take(&c, 2).expect("second");
        assert!(
            ClientHold::try_take(&c, 2).is_none(),
            "third is over the limit"
        );
        assert_eq!(
            c.load(Ordering::SeqCst),
            2,
            "a refusal leaves no count behind"
        );
        drop(a);
        let again = ClientHold::try_take(&c, 2).expect("room again");
        drop((b, again));
        assert_eq!(c.load(Ordering::SeqCst), 0);
    }
}
