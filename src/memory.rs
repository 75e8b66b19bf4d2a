//! The in-flight byte budget: the bytes of request bodies and engine answers that pdgate
//! holds at once, across every request, are at most `admission.max_bytes_in_flight`.
//!
//! Why: admission counts requests, but a request's memory is its body (held whole for
//! retries, since a leg is written from it) and, for some, a buffered answer (the prefill's
//! answer, read whole; the prefill's input logprobs kept to merge into decode's events; a
//! non-streamed decode answer whose logprobs are merged). Without a byte bound, a few large
//! bodies take the process past its memory limit and every stream on it dies with it.
//!
//! What is charged: what is held, as it is read (a body as its frames arrive, an answer as
//! its frames arrive), so that a client that declares a large body and sends it slowly
//! holds only what it sent. A body whose declared length does not fit now is refused at its
//! head ([`ByteBudget::check`]), before any of it is read: a flood of maximum-size bodies
//! then costs the router a head each, not megabytes of reading per refusal. A [`Charge`]
//! gives its bytes back when dropped: it travels with what it pays for (the request's
//! admission slot for the body, which is released when the response body ends or a prefill
//! leg left running ends; the merged logprobs for theirs).
//!
//! Refusals: a charge that could never fit is [`Refusal::Never`] (413 to the client); one
//! that does not fit now is [`Refusal::Full`] (503 with `Retry-After`). A large charge (a
//! request holding more than 1/64 of the budget) may bring the budget to 7/8 of its limit
//! only: the last eighth stays for small requests, so a flood of maximum-size bodies fills
//! the budget without refusing ordinary traffic. The callers map them to failures (`crate::admission`); this
//! module is a leaf below it (only `telemetry`).
//!
//! Invariants: `used` never exceeds the limit by a successful charge, nor 7/8 of it by a
//! large one (one CAS loop, no
//! lock); it returns to 0 when nothing is held, which the chaos soak's gauges check; the
//! limit changes in place on reload (a lower limit refuses new charges until enough is
//! given back, and cuts nothing in flight).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use metrics::Gauge;

use crate::telemetry;

/// The process's resident memory at rest (14 MiB measured after start by
/// `benches/hostile.rs`, with headroom): the runtime, the pool, the metrics registry.
pub const RSS_BASE_BYTES: u64 = 24 << 20;
/// Resident memory per byte of the budget in use: the charged bytes themselves, plus what
/// the allocator keeps around them (an allowance; the one hostile run stayed under the
/// whole bound, the factor alone was not isolated).
pub const RSS_PER_BUDGET_BYTE: f64 = 1.25;
/// Resident memory per open client connection with no request in flight (a task, hyper's
/// connection state and its first read buffer; an allowance, not isolated by a bench).
pub const RSS_PER_CONNECTION_BYTES: u64 = 8 << 10;

/// The bound on the process's resident memory that the defaults and the Kubernetes
/// manifests are sized by (docs/pools-and-capacity.md, "Memory"): base, plus budget x
/// factor, plus connections x per-connection cost. `connections` is how many client
/// connections to plan for (at most `server.max_connections`).
pub fn rss_bound(max_bytes_in_flight: usize, connections: usize) -> u64 {
    RSS_BASE_BYTES
        + (max_bytes_in_flight as f64 * RSS_PER_BUDGET_BYTE) as u64
        + connections as u64 * RSS_PER_CONNECTION_BYTES
}

/// The budget shared by every request of one front door.
#[derive(Debug)]
pub struct ByteBudget {
    used: AtomicUsize,
    limit: AtomicUsize,
    gauge: Gauge,
}

/// Why a charge was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The charge (with what it already held) is larger than the whole budget.
    Never { wanted: usize, limit: usize },
    /// The budget is momentarily full.
    Full { wanted: usize, limit: usize },
}

impl ByteBudget {
    pub fn new(limit: usize) -> Arc<ByteBudget> {
        Arc::new(ByteBudget {
            used: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
            gauge: metrics::gauge!(telemetry::BYTES_IN_FLIGHT),
        })
    }

    /// Changes the limit in place (a reload).
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
    }

    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Bytes charged now.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// An empty charge on this budget, to grow as bytes arrive.
    pub fn charge(self: &Arc<Self>) -> Charge {
        Charge {
            budget: Some(self.clone()),
            bytes: 0,
            also: None,
        }
    }

    /// The most a charge of `wanted` bytes may bring the budget to: a large charge (more
    /// than 1/64 of the budget) leaves the last eighth to small ones, so that a flood of
    /// large bodies cannot refuse ordinary requests.
    fn cap_for(limit: usize, wanted: usize) -> usize {
        if wanted > limit / 64 {
            limit - limit / 8
        } else {
            limit
        }
    }

    /// The largest single body or answer that can ever be charged under `limit`.
    pub fn largest_charge(limit: usize) -> usize {
        limit - limit / 8
    }

    /// Whether a charge of `wanted` bytes would be taken now, without taking it: a body's
    /// declared length is checked before a byte of it is read, so that a body the budget
    /// cannot hold is refused at its head instead of being read part-way first (the
    /// charge itself is still taken as the bytes arrive). A later charge may still be
    /// refused: others take and give back in between.
    pub fn check(&self, wanted: usize) -> Result<(), Refusal> {
        let limit = self.limit();
        let cap = Self::cap_for(limit, wanted);
        if wanted > cap {
            return Err(Refusal::Never { wanted, limit: cap });
        }
        if self.used().saturating_add(wanted) > cap {
            return Err(Refusal::Full { wanted, limit });
        }
        Ok(())
    }

    /// Takes `n` more bytes for a charge already holding `held`.
    fn take(&self, held: usize, n: usize) -> Result<(), Refusal> {
        if n == 0 {
            return Ok(());
        }
        let limit = self.limit();
        let wanted = held.saturating_add(n);
        let cap = Self::cap_for(limit, wanted);
        if wanted > cap {
            return Err(Refusal::Never { wanted, limit: cap });
        }
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= cap)
            })
            .map_err(|_| Refusal::Full { wanted, limit })?;
        self.gauge.increment(n as f64);
        Ok(())
    }

    fn give_back(&self, n: usize) {
        if n > 0 {
            self.used.fetch_sub(n, Ordering::AcqRel);
            self.gauge.decrement(n as f64);
        }
    }
}

/// Bytes held against a [`ByteBudget`], given back when dropped. A charge without a budget
/// ([`Charge::none`]) counts nothing and refuses nothing.
#[derive(Debug, Default)]
pub struct Charge {
    budget: Option<Arc<ByteBudget>>,
    bytes: usize,
    also: Option<Box<Charge>>,
}

impl Charge {
    /// A charge that counts nothing (no budget: a probe request, a test).
    pub fn none() -> Charge {
        Charge::default()
    }

    /// An empty charge on the same budget (or on none).
    pub fn sibling(&self) -> Charge {
        Charge {
            budget: self.budget.clone(),
            bytes: 0,
            also: None,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Holds `n` more bytes, or says why not (nothing is taken then).
    pub fn grow(&mut self, n: usize) -> Result<(), Refusal> {
        if let Some(b) = &self.budget {
            b.take(self.bytes, n)?;
        }
        self.bytes = self.bytes.saturating_add(n);
        Ok(())
    }

    /// Holds exactly `n` bytes: gives back the excess, or grows (which may be refused).
    pub fn resize(&mut self, n: usize) -> Result<(), Refusal> {
        if n >= self.bytes {
            return self.grow(n - self.bytes);
        }
        if let Some(b) = &self.budget {
            b.give_back(self.bytes - n);
        }
        self.bytes = n;
        Ok(())
    }

    /// Takes over what `other` holds; both are given back together.
    pub fn absorb(&mut self, mut other: Charge) {
        match (&self.budget, &other.budget) {
            // `other` took nothing from any budget.
            (_, None) => {}
            // Neither did `self`: it becomes `other`.
            (None, Some(_)) => *self = other,
            (Some(a), Some(b)) if Arc::ptr_eq(a, b) => {
                self.bytes = self.bytes.saturating_add(std::mem::take(&mut other.bytes));
            }
            // Another budget (not the case in pdgate: one front door, one budget): kept
            // alongside, given back with this one.
            (Some(_), Some(_)) => match &mut self.also {
                Some(also) => also.absorb(other),
                None => self.also = Some(Box::new(other)),
            },
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.give_back(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn charges_refuse_past_the_budget_and_give_back_on_drop() {
        // 6400 bytes: charges over 100 are large and may fill only 5600 (7/8).
        let b = ByteBudget::new(6400);
        let mut a = b.charge();
        a.grow(4000).expect("fits");
        let mut c = b.charge();
        let full = |wanted| {
            Err(Refusal::Full {
                wanted,
                limit: 6400,
            })
        };
        let never = |wanted| {
            Err(Refusal::Never {
                wanted,
                limit: 5600,
            })
        };
        // (grow by, expected) on a second charge while `a` holds 4000.
        let cases = [
            (2000, full(2000)),
            (5601, never(5601)),
            (1600, Ok(())),
            (1, full(1601)),
        ];
        for (n, want) in cases {
            // `check` says what a fresh charge of `n` would get, and takes nothing.
            let used = b.used();
            if c.bytes() == 0 {
                assert_eq!(b.check(n), want, "check {n}");
            }
            assert_eq!(b.used(), used, "a check takes nothing");
            assert_eq!(c.grow(n), want, "grow {n}");
        }
        assert_eq!(
            (b.used(), c.bytes()),
            (5600, 1600),
            "a refusal takes nothing"
        );
        // The last eighth is for small charges.
        let mut small = b.charge();
        small.grow(100).expect("a small charge fits in the reserve");
        assert!(matches!(b.charge().grow(101), Err(Refusal::Full { .. })));
        drop((a, small));
        assert_eq!(b.used(), 1600);
        c.resize(10).expect("shrinks");
        assert_eq!(b.used(), 10);
        c.absorb(Charge::none());
        let mut d = b.charge();
        d.grow(5).expect("fits");
        c.absorb(d);
        assert_eq!((b.used(), c.bytes()), (15, 15));
        drop(c);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn a_lower_limit_refuses_new_charges_and_cuts_nothing() {
        let b = ByteBudget::new(6400);
        let mut a = b.charge();
        a.grow(5000).expect("fits");
        b.set_limit(3200);
        assert!(matches!(b.charge().grow(1), Err(Refusal::Full { .. })));
        assert_eq!(a.bytes(), 5000);
        drop(a);
        b.charge().grow(2800).expect("fits the new limit's 7/8");
    }

    /// Config validation applies the same rule (it cannot import this module).
    #[test]
    fn config_validation_agrees_on_the_largest_charge() {
        let mut cfg = crate::config::Config::default();
        cfg.server.max_body_bytes = ByteBudget::largest_charge(cfg.admission.max_bytes_in_flight);
        assert!(cfg.validate().is_ok());
        cfg.server.max_body_bytes += 1;
        assert!(cfg.validate().is_err());
    }

    proptest! {
        /// Whatever the order of grows and drops, the budget is never exceeded by a
        /// successful charge, a large one never brings it past 7/8, and every byte comes
        /// back.
        #[test]
        fn never_over_and_back_to_zero(ops in proptest::collection::vec((0usize..4, 0usize..3000), 1..60)) {
            let b = ByteBudget::new(6400);
            let mut held: Vec<Charge> = (0..4).map(|_| b.charge()).collect();
            for (i, n) in ops {
                if n % 7 == 0 {
                    held[i] = b.charge();
                } else {
                    let before = b.used();
                    match held[i].grow(n) {
                        Err(_) => prop_assert_eq!(b.used(), before),
                        Ok(()) if held[i].bytes() > 100 => prop_assert!(b.used() <= 5600),
                        Ok(()) => {}
                    }
                }
                prop_assert!(b.used() <= 6400);
                prop_assert_eq!(b.used(), held.iter().map(Charge::bytes).sum::<usize>());
            }
            drop(held);
            prop_assert_eq!(b.used(), 0);
        }
    }
}
