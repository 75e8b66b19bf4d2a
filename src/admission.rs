//! Admission: at most `max_in_flight` requests are served at once; up to `max_queue` more
//! wait (each at most `queue_timeout`) for a slot. A full queue answers 429 and a wait that
//! times out answers 503, both with `Retry-After`.
//!
//! Invariant: a slot is held until the response body ends (or is dropped), so a long
//! stream counts for its whole life, and past it by a prefill leg still answering (see
//! `pd::flight`): the slot travels with the request. The fast path is one atomic
//! (`try_acquire`).
//!
//! Its own module (not the front door's) because both the front door (which admits) and
//! `pd` (whose response body and detached legs hold the slot) use it.
//!
//! Gauges (handles registered once): `pdgate_in_flight_requests` counts the PD requests
//! admitted whose response has not ended (also when `max_in_flight` is 0, i.e. no limit),
//! `pdgate_admission_queue` those waiting for a slot. Both are moved by drop guards, so
//! every way a request ends (answer, error, client gone) brings them back: at rest both are
//! 0, which the chaos soak checks.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use metrics::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::AdmissionConfig;
use crate::error::{FailReason, Failure};

pub struct Admission {
    slots: Option<Arc<Semaphore>>,
    waiting: AtomicUsize,
    max_queue: usize,
    timeout: Duration,
    in_flight: Gauge,
    queued: Gauge,
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
    in_flight: Gauge,
}

impl Slot {
    fn new(permit: Option<OwnedSemaphorePermit>, in_flight: &Gauge) -> Slot {
        in_flight.increment(1.0);
        Slot {
            _permit: permit,
            _client: None,
            in_flight: in_flight.clone(),
        }
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
            slots: (cfg.max_in_flight > 0).then(|| Arc::new(Semaphore::new(cfg.max_in_flight))),
            waiting: AtomicUsize::new(0),
            max_queue: cfg.max_queue,
            timeout: Duration::from_millis(cfg.queue_timeout_ms),
            in_flight: metrics::gauge!("pdgate_in_flight_requests"),
            queued: metrics::gauge!("pdgate_admission_queue"),
        }
    }

    /// A slot for one request, or the failure to answer with.
    pub async fn admit(&self) -> Result<Slot, Failure> {
        let Some(slots) = &self.slots else {
            return Ok(Slot::new(None, &self.in_flight));
        };
        if let Ok(p) = Arc::clone(slots).try_acquire_owned() {
            return Ok(Slot::new(Some(p), &self.in_flight));
        }
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= self.max_queue {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!("pdgate_admission_rejected_total", "reason" => "queue_full")
                .increment(1);
            return Err(Failure::new(
                FailReason::Overloaded,
                "too many requests in flight and the wait queue is full",
            ));
        }
        self.queued.increment(1.0);
        let _w = Waiting(&self.waiting, &self.queued);
        match tokio::time::timeout(self.timeout, Arc::clone(slots).acquire_owned()).await {
            Ok(Ok(p)) => Ok(Slot::new(Some(p), &self.in_flight)),
            Ok(Err(_)) => Err(Failure::new(FailReason::Internal, "admission closed")),
            Err(_) => {
                metrics::counter!("pdgate_admission_rejected_total", "reason" => "queue_timeout")
                    .increment(1);
                Err(Failure::new(
                    FailReason::QueueTimeout,
                    format!(
                        "no slot within the queue timeout of {} ms",
                        self.timeout.as_millis()
                    ),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
