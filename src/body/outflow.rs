//! What a response body hands hyper: a slice at a time, with a yield to the event loop
//! after each slice, and, for streams that repeat a prompt's input logprobs in every event,
//! no faster than the router-wide [`ByteRate`] allows.
//!
//! Why: hyper writes what a body yields and polls it again while the client's socket takes
//! the bytes, so one body can hold the event loop for as long as it has bytes ready. A
//! slice per frame bounds one poll; the rate bounds the share of the router a stream that
//! amplifies its prompt (a long prompt's input logprobs, repeated in each of its events:
//! megabytes a second from one client) can take, whatever the number of such streams.
//! Everything else (ordinary streams and answers) is never held back.
//!
//! Invariants: bytes come out in the order they went in, each exactly once; a frame held
//! for the rate is handed out before anything after it; [`Outflow::is_empty`] is false
//! while any is held.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use tokio::time::{Instant, Sleep};

use super::SLICE_BYTES;

/// A shared byte rate, as a generic cell rate algorithm (GCRA): each reservation pushes the
/// theoretical arrival time (TAT) forward by its bytes' time at the rate; a reservation that
/// lands more than the burst ahead of now waits until it is within it. Lock-free (one CAS
/// loop), fair in reservation order, and costless while under the rate.
#[derive(Debug)]
pub struct ByteRate {
    bytes_per_sec: u64,
    burst: Duration,
    epoch: Instant,
    /// Nanoseconds since `epoch`.
    tat: AtomicU64,
}

impl ByteRate {
    /// `bytes_per_sec` (at least 1), with up to `burst` worth of bytes sent at once.
    pub fn new(bytes_per_sec: u64, burst: Duration) -> ByteRate {
        ByteRate {
            bytes_per_sec: bytes_per_sec.max(1),
            burst,
            epoch: Instant::now(),
            tat: AtomicU64::new(0),
        }
    }

    pub fn bytes_per_sec(&self) -> u64 {
        self.bytes_per_sec
    }

    /// Reserves `n` bytes at `now`: how long to wait before sending them (zero within the
    /// rate and its burst).
    pub fn reserve(&self, n: usize, now: Instant) -> Duration {
        let now_ns = nanos(now.saturating_duration_since(self.epoch));
        let burst_ns = nanos(self.burst);
        let cost = u64::try_from(n as u128 * 1_000_000_000 / u128::from(self.bytes_per_sec))
            .unwrap_or(u64::MAX);
        let mut cur = self.tat.load(Ordering::Relaxed);
        loop {
            let next = cur.max(now_ns).saturating_add(cost);
            match self
                .tat
                .compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => {
                    return Duration::from_nanos(
                        next.saturating_sub(now_ns.saturating_add(burst_ns)),
                    )
                }
                Err(seen) => cur = seen,
            }
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A body's output: see the module docs.
#[derive(Debug, Default)]
pub struct Outflow {
    /// What is left of a frame larger than [`SLICE_BYTES`], handed out next.
    rest: Option<Bytes>,
    /// Bytes handed out since the last yield to the event loop.
    unyielded: usize,
    /// The next poll yields first (a slice's worth went out).
    yield_due: bool,
    /// The rate this body's bytes are held to, when it repeats input logprobs.
    rate: Option<Arc<ByteRate>>,
    /// A frame reserved at the rate, waiting for its time.
    held: Option<(Bytes, Pin<Box<Sleep>>)>,
}

impl Outflow {
    /// Holds this body's bytes to `rate` from now on.
    pub fn set_rate(&mut self, rate: Option<Arc<ByteRate>>) {
        self.rate = rate;
    }

    /// What goes out before the body reads anything new: a due yield (`Pending`), then a
    /// held frame once its time came, then the rest of the last frame. `Ready(None)`: the
    /// body may produce its next frame.
    pub fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if self.yield_due {
            self.yield_due = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if let Some((_, sleep)) = self.held.as_mut() {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            return Poll::Ready(self.held.take().map(|(data, _)| data));
        }
        match self.rest.take() {
            Some(rest) => self.send(rest, cx).map(Some),
            None => Poll::Ready(None),
        }
    }

    /// Hands out `data`: its first slice now or, past the rate, once its time comes
    /// (`Pending`, woken then); the rest on the next polls.
    pub fn send(&mut self, mut data: Bytes, cx: &mut Context<'_>) -> Poll<Bytes> {
        if data.len() > SLICE_BYTES {
            self.rest = Some(data.split_off(SLICE_BYTES));
        }
        self.unyielded += data.len();
        if self.unyielded >= SLICE_BYTES {
            self.unyielded = 0;
            self.yield_due = true;
        }
        if let Some(rate) = &self.rate {
            let wait = rate.reserve(data.len(), Instant::now());
            if !wait.is_zero() {
                let mut sleep = Box::pin(tokio::time::sleep(wait));
                if sleep.as_mut().poll(cx).is_pending() {
                    self.held = Some((data, sleep));
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(data)
    }

    /// Nothing is held or left to hand out.
    pub fn is_empty(&self) -> bool {
        self.rest.is_none() && self.held.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_rate_spaces_reservations_past_its_burst() {
        // 1 MB/s, 10 ms of burst: 10 KB go at once, then 1 ms per KB.
        let r = ByteRate::new(1_000_000, Duration::from_millis(10));
        let t0 = Instant::now();
        let cases: &[(usize, u64)] = &[
            // (bytes, wait in µs) at t0, one after the other.
            (5_000, 0),
            (5_000, 0),
            (1_000, 1_000),
            (2_000, 3_000),
        ];
        for &(n, us) in cases {
            assert_eq!(r.reserve(n, t0), Duration::from_micros(us), "{n}");
        }
        // Time passes: the debt is paid, and the burst is back (not more).
        let later = t0 + Duration::from_secs(1);
        assert_eq!(r.reserve(10_000, later), Duration::ZERO);
        assert_eq!(r.reserve(1_000, later), Duration::from_millis(1));
    }

    #[tokio::test(start_paused = true)]
    async fn an_outflow_hands_out_every_byte_in_order_and_waits_for_the_rate() {
        let rate = Arc::new(ByteRate::new(SLICE_BYTES as u64, Duration::ZERO));
        let mut out = Outflow::default();
        out.set_rate(Some(rate));
        let data: Vec<u8> = (0..SLICE_BYTES * 3 + 100).map(|i| i as u8).collect();
        let t0 = Instant::now();
        let mut first = Some(Bytes::from(data.clone()));
        let mut got = Vec::new();
        let mut frames = 0;
        while !(first.is_none() && out.is_empty()) {
            let frame = std::future::poll_fn(|cx| match first.take() {
                Some(d) => out.send(d, cx).map(Some),
                None => out.poll_pending(cx),
            })
            .await;
            if let Some(f) = frame {
                assert!(f.len() <= SLICE_BYTES);
                got.extend_from_slice(&f);
                frames += 1;
            }
        }
        assert_eq!(got, data);
        assert_eq!(frames, 4);
        // A slice a second, no burst: each slice waits for its second.
        let spent = Instant::now() - t0;
        assert!(spent >= Duration::from_millis(3_000), "{spent:?}");
        assert!(spent < Duration::from_millis(3_100), "{spent:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_pacer_lets_a_small_body_through_and_holds_a_large_one_to_its_rate() {
        let rate = Arc::new(ByteRate::new(1_000_000, Duration::ZERO));
        // A small body, in pieces: never waits.
        let t0 = Instant::now();
        let mut small = super::super::Pacer::with_rate(Some(&rate));
        for _ in 0..4 {
            small.moved(SLICE_BYTES / 4).await;
        }
        assert_eq!(Instant::now(), t0, "the first slice is free");
        // A large body: what is past its first slice goes at 1 MB/s.
        let mut large = super::super::Pacer::with_rate(Some(&rate));
        large.moved(SLICE_BYTES).await;
        large.moved(500_000).await;
        large.moved(500_000).await;
        let spent = Instant::now() - t0;
        assert_eq!(spent, Duration::from_secs(1), "{spent:?}");
    }

    #[tokio::test]
    async fn without_a_rate_nothing_waits() {
        let mut out = Outflow::default();
        let f = std::future::poll_fn(|cx| out.send(Bytes::from_static(b"data: x\n\n"), cx)).await;
        assert_eq!(&f[..], b"data: x\n\n");
        assert!(out.is_empty());
    }
}
