//! A histogram kept in atomics, for derived series: one per worker and leg kind, observed
//! on the request path with a few relaxed atomic adds (no lock, no label lookup) and
//! rendered at scrape time by [`super::Exposition::histogram`].
//!
//! Invariants: the buckets are a table's (`&'static`, ascending, seconds); `counts[i]`
//! counts observations `<= buckets[i]` that fit no lower bucket, the last slot those above
//! every bucket (`+Inf`); the sum is kept in microseconds, so it never drifts with float
//! additions. A scrape reads each atomic once: it may see an observation in its bucket and
//! not yet in the sum (off by one sample, never torn).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The most buckets a histogram has (a table's bucket list is checked against it).
pub const MAX_BUCKETS: usize = 24;

/// Observations of a duration, bucketed.
#[derive(Debug)]
pub struct AtomicHistogram {
    buckets: &'static [f64],
    /// One per bucket, then `+Inf` (the slots past it unused): a fixed array, so that a
    /// histogram can be a `static`.
    counts: [AtomicU64; MAX_BUCKETS + 1],
    sum_micros: AtomicU64,
}

impl AtomicHistogram {
    /// Panics (at compile time for a `static`) when `buckets` has more than
    /// [`MAX_BUCKETS`].
    pub const fn new(buckets: &'static [f64]) -> AtomicHistogram {
        assert!(buckets.len() <= MAX_BUCKETS, "too many buckets");
        AtomicHistogram {
            buckets,
            counts: [const { AtomicU64::new(0) }; MAX_BUCKETS + 1],
            sum_micros: AtomicU64::new(0),
        }
    }

    /// One observation.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self.buckets.partition_point(|&b| b < secs);
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(1, Ordering::Relaxed);
        }
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// `(upper bound, cumulative count)` per bucket, `+Inf` last as `None`; then the sum
    /// in seconds.
    pub fn read(&self) -> (Vec<(Option<f64>, u64)>, f64) {
        let mut acc = 0u64;
        let used = &self.counts[..=self.buckets.len()];
        let mut out = Vec::with_capacity(used.len());
        for (i, c) in used.iter().enumerate() {
            acc = acc.saturating_add(c.load(Ordering::Relaxed));
            out.push((self.buckets.get(i).copied(), acc));
        }
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        (out, sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_cumulative_and_bounds_inclusive() {
        static B: &[f64] = &[0.01, 0.1, 1.0];
        let h = AtomicHistogram::new(B);
        for ms in [5, 10, 50, 100, 2000] {
            h.observe(Duration::from_millis(ms));
        }
        let (b, sum) = h.read();
        assert_eq!(
            b,
            vec![(Some(0.01), 2), (Some(0.1), 4), (Some(1.0), 4), (None, 5)]
        );
        assert!((sum - 2.165).abs() < 1e-9, "{sum}");
    }
}
