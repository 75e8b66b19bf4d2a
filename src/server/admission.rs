//! Admission: at most `max_in_flight` requests are served at once; up to `max_queue` more
//! wait (each at most `queue_timeout`) for a slot. A full queue answers 429 and a wait that
//! times out answers 503, both with `Retry-After`.
//!
//! Invariant: a slot is held until the response body ends (or is dropped), so a long
//! stream counts for its whole life, and past it by a prefill leg still answering (see
//! `pd::flight`). The fast path is one atomic (`try_acquire`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::config::AdmissionConfig;
use crate::error::{FailReason, Failure};

pub struct Admission {
    slots: Option<Arc<Semaphore>>,
    waiting: AtomicUsize,
    max_queue: usize,
    timeout: Duration,
}

/// Decrements the wait count however the wait ends.
struct Waiting<'a>(&'a AtomicUsize);
impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Admission {
    pub fn new(cfg: &AdmissionConfig) -> Admission {
        Admission {
            slots: (cfg.max_in_flight > 0).then(|| Arc::new(Semaphore::new(cfg.max_in_flight))),
            waiting: AtomicUsize::new(0),
            max_queue: cfg.max_queue,
            timeout: Duration::from_millis(cfg.queue_timeout_ms),
        }
    }

    /// A slot for one request, or the failure to answer with.
    pub async fn admit(&self) -> Result<Option<OwnedSemaphorePermit>, Failure> {
        let Some(slots) = &self.slots else {
            return Ok(None);
        };
        if let Ok(p) = Arc::clone(slots).try_acquire_owned() {
            return Ok(Some(p));
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
        let _w = Waiting(&self.waiting);
        match tokio::time::timeout(self.timeout, Arc::clone(slots).acquire_owned()).await {
            Ok(Ok(p)) => Ok(Some(p)),
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
