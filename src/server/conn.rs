//! One client connection: its protocol sniffed from the first bytes (read once, under one
//! deadline, then replayed to hyper), its place under
//! `server.max_connections`, an idle timer for HTTP/2, and its graceful end on drain.
//!
//! Invariants:
//! - At most `max_connections` connections are served at once; one beyond the limit gets a
//!   whole `503 too_many_connections` HTTP/1.1 answer (`Retry-After`, `Connection: close`)
//!   written straight to its socket, and is closed, so a balancer in front retries
//!   elsewhere at once. Nothing of its request is read or dispatched.
//! - A connection that sends nothing within `header_read_timeout` is closed (hyper's
//!   header timer only starts once the protocol is known).
//! - An HTTP/2 connection (prior knowledge, h2c) with no open stream for `idle_timeout` is
//!   shut down gracefully (GOAWAY): HTTP/1 connections are bounded between requests by the
//!   header timer, HTTP/2 has no such timer. Only HTTP/2 pays for the activity tracking.
//! - On drain every connection is shut down gracefully: in-flight requests finish, then the
//!   connection closes; [`Registry::wait_empty`] returns when none is left.

use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

use crate::error::{FailReason, Failure};

/// The HTTP/2 connection preface's first bytes (RFC 9113 §3.4); no HTTP/1 method is `PRI`.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0";

/// The open connections: a count under the limit, and a wake-up when it reaches 0.
#[derive(Debug, Default)]
pub struct Registry {
    open: AtomicUsize,
    emptied: Notify,
}

/// One open connection's place in the [`Registry`]; freed when dropped.
#[derive(Debug)]
pub struct Slot(Arc<Registry>);

impl Drop for Slot {
    fn drop(&mut self) {
        let left = self.0.open.fetch_sub(1, Ordering::AcqRel) - 1;
        // Increments and decrements commute: threads racing here cannot leave a stale
        // value behind, as two racing `set`s could.
        metrics::gauge!(crate::telemetry::OPEN_CONNECTIONS).decrement(1.0);
        if left == 0 {
            self.0.emptied.notify_waiters();
        }
    }
}

impl Registry {
    /// A place for a new connection, or `None` at the limit (0 = no limit).
    pub fn enter(self: &Arc<Self>, max: usize) -> Option<Slot> {
        self.open
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (max == 0 || n < max).then_some(n + 1)
            })
            .ok()?;
        metrics::gauge!(crate::telemetry::OPEN_CONNECTIONS).increment(1.0);
        Some(Slot(self.clone()))
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Acquire)
    }

    /// Returns once no connection is open.
    pub async fn wait_empty(&self) {
        loop {
            let emptied = self.emptied.notified();
            if self.open() == 0 {
                return;
            }
            emptied.await;
        }
    }
}

/// Refusals being written at once; past it a connection beyond the limit is closed
/// without an answer, so a flood of connections cannot pile up tasks.
pub const MAX_REFUSALS_IN_FLIGHT: usize = 64;

/// Answers a connection beyond the limit and closes it (bounded: one second to write, and
/// at most [`MAX_REFUSALS_IN_FLIGHT`] at once, counted by `refusals`).
pub fn refuse(stream: TcpStream, max: usize, refusals: &Arc<tokio::sync::Semaphore>) {
    metrics::counter!(crate::telemetry::CONNECTIONS_REJECTED).increment(1);
    let Ok(permit) = refusals.clone().try_acquire_owned() else {
        drop(stream);
        return;
    };
    tokio::spawn(async move {
        let _permit = permit;
        write_refusal(stream, max).await;
    });
}

async fn write_refusal(mut stream: TcpStream, max: usize) {
    let answer = Failure::new(
        FailReason::TooManyConnections,
        format!("the router serves at most {max} connections at once (server.max_connections)"),
    )
    .raw_http1();
    let write = async {
        stream.write_all(&answer).await?;
        stream.shutdown().await
    };
    let _ = tokio::time::timeout(Duration::from_secs(1), write).await;
}

/// What the first bytes say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sniffed {
    Http1,
    H2,
    /// Closed, broken, or silent past the deadline.
    Nothing,
}

/// Reads (up to `within`, one deadline for all of it) the first bytes, at most the
/// preface's length, and tells HTTP/2 prior knowledge from HTTP/1 by the preface. The bytes
/// read are returned in a [`Prefixed`] stream that replays them, so hyper sees the
/// connection whole.
///
/// Each read waits for new bytes: a client that sends a prefix of the preface and stalls
/// costs one wake-up per segment it sends, never a timer loop (peeking would find the
/// socket readable again and again while the prefix sits unread in it).
pub async fn sniff<S: AsyncRead + Unpin>(
    mut stream: S,
    within: Duration,
) -> (Sniffed, Prefixed<S>) {
    let deadline = tokio::time::Instant::now() + within;
    let mut head = [0u8; H2_PREFACE.len()];
    let mut got = 0;
    let sniffed = loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut head[got..])).await {
            Ok(Ok(n)) if n > 0 => got += n,
            _ => break Sniffed::Nothing,
        }
        if !H2_PREFACE.starts_with(&head[..got]) {
            break Sniffed::Http1;
        }
        if got == H2_PREFACE.len() {
            break Sniffed::H2;
        }
    };
    let prefixed = Prefixed {
        head,
        pos: 0,
        len: got,
        inner: stream,
    };
    (sniffed, prefixed)
}

/// A stream whose first bytes were already read by [`sniff`]: reads give them back first,
/// then read the stream; writes go straight to it (vectored writes included).
#[derive(Debug)]
pub struct Prefixed<S> {
    head: [u8; H2_PREFACE.len()],
    pos: usize,
    len: usize,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.pos < this.len {
            let n = (this.len - this.pos).min(buf.remaining());
            buf.put_slice(&this.head[this.pos..this.pos + n]);
            this.pos += n;
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Streams in flight on an HTTP/2 connection and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    active: AtomicUsize,
    /// Milliseconds since `start` when the connection last went idle.
    idle_since_ms: AtomicU64,
    start: tokio::time::Instant,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            active: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            start: tokio::time::Instant::now(),
        })
    }

    /// A stream began; it ends when the guard drops.
    pub fn begin(self: &Arc<Self>) -> StreamGuard {
        self.active.fetch_add(1, Ordering::AcqRel);
        StreamGuard(self.clone())
    }

    /// When the connection has been idle for `idle`: `None` while a stream is open.
    fn idle_deadline(&self, idle: Duration) -> Option<tokio::time::Instant> {
        if self.active.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        Some(self.start + since + idle)
    }

    /// Resolves once the connection has had no stream for `idle`.
    pub async fn idle_for(&self, idle: Duration) {
        loop {
            match self.idle_deadline(idle) {
                Some(at) if at <= tokio::time::Instant::now() => return,
                Some(at) => tokio::time::sleep_until(at).await,
                // Busy: look again after one idle period.
                None => tokio::time::sleep(idle).await,
            }
        }
    }
}

/// One HTTP/2 stream in flight; dropped with its response body.
#[derive(Debug)]
pub struct StreamGuard(Arc<Activity>);

impl Drop for StreamGuard {
    fn drop(&mut self) {
        let a = &self.0;
        let ms = a.start.elapsed().as_millis() as u64;
        a.idle_since_ms.store(ms, Ordering::Release);
        a.active.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_limit_holds_and_slots_free_on_drop() {
        let r = Arc::new(Registry::default());
        let a = r.enter(2).expect("first");
        let b = r.enter(2).expect("second");
        assert!(r.enter(2).is_none(), "at the limit");
        drop(a);
        let c = r.enter(2).expect("freed");
        assert_eq!(r.open(), 2);
        drop((b, c));
        assert_eq!(r.open(), 0);
        // 0: no limit.
        let many: Vec<_> = (0..100).map(|_| r.enter(0).expect("no limit")).collect();
        assert_eq!(r.open(), 100);
        drop(many);
    }

    #[tokio::test(start_paused = true)]
    async fn idle_timer_waits_for_the_last_stream() {
        let a = Activity::new();
        let idle = Duration::from_secs(10);
        let g = a.begin();
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(a.idle_deadline(idle).is_none(), "busy is never idle");
        drop(g);
        let t0 = tokio::time::Instant::now();
        a.idle_for(idle).await;
        assert_eq!(t0.elapsed(), idle, "idle counts from the last stream's end");
    }

    /// A client that sends `parts` one read at a time, then stalls (never ready again);
    /// counts how often it is read.
    struct Client {
        parts: Vec<&'static [u8]>,
        reads: Arc<AtomicUsize>,
    }

    impl AsyncRead for Client {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            self.reads.fetch_add(1, Ordering::Relaxed);
            if self.parts.is_empty() {
                return Poll::Pending;
            }
            let part = self.parts.remove(0);
            let n = part.len().min(buf.remaining());
            buf.put_slice(&part[..n]);
            if n < part.len() {
                self.parts.insert(0, &part[n..]);
            }
            Poll::Ready(Ok(()))
        }
    }

    async fn sniff_parts(parts: Vec<&'static [u8]>) -> (Sniffed, Vec<u8>, usize) {
        let reads = Arc::new(AtomicUsize::new(0));
        let client = Client {
            parts,
            reads: reads.clone(),
        };
        let (sniffed, mut prefixed) = sniff(client, Duration::from_secs(10)).await;
        // What the prefix replays (the stalled client adds nothing after it).
        let mut replay = vec![0u8; 64];
        let n = match tokio::time::timeout(Duration::from_millis(1), prefixed.read(&mut replay))
            .await
        {
            Ok(r) => r.expect("read"),
            Err(_) => 0,
        };
        replay.truncate(n);
        (sniffed, replay, reads.load(Ordering::Relaxed))
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_partial_preface_is_read_once_then_waited_on() {
        // One byte of the preface, then silence for the whole header deadline: one read
        // that got the byte, one that parked, one more as the deadline fires (the timeout
        // polls its future first); no timer loop (the old peek-and-sleep sniff looked at
        // the socket every millisecond, 10,000 times here).
        let (sniffed, replay, reads) = sniff_parts(vec![b"P"]).await;
        assert_eq!(sniffed, Sniffed::Nothing);
        assert_eq!(replay, b"P");
        assert_eq!(reads, 3, "one read per arrival, then a parked wait");
    }

    /// (what the client sends, read by read; the verdict; what the prefix replays)
    type Case = (Vec<&'static [u8]>, Sniffed, &'static [u8]);

    #[tokio::test(start_paused = true)]
    async fn sniff_tells_protocols_apart_and_replays_what_it_read() {
        let cases: &[Case] = &[
            (
                vec![b"GET / HTTP/1.1\r\n"],
                Sniffed::Http1,
                b"GET / HTTP/1.1",
            ),
            (vec![b"P", b"OST /g"], Sniffed::Http1, b"POST /g"),
            (vec![b"PRI * HTTP/2.0"], Sniffed::H2, b"PRI * HTTP/2.0"),
            (
                vec![b"PR", b"I * HT", b"TP/2.0"],
                Sniffed::H2,
                b"PRI * HTTP/2.0",
            ),
            (vec![b"PRI * H"], Sniffed::Nothing, b"PRI * H"),
            (vec![], Sniffed::Nothing, b""),
        ];
        for (parts, want, replay_want) in cases {
            let (sniffed, replay, _) = sniff_parts(parts.clone()).await;
            assert_eq!(sniffed, *want, "{parts:?}");
            assert_eq!(replay, *replay_want, "{parts:?}");
        }
    }

    #[test]
    fn refusal_is_a_whole_http1_answer() {
        let f = Failure::new(FailReason::TooManyConnections, "full");
        let raw = String::from_utf8(f.raw_http1()).expect("ascii");
        assert!(
            raw.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
            "{raw}"
        );
        assert!(
            raw.contains("\r\nconnection: close\r\n") && raw.contains("\r\nretry-after: 1\r\n")
        );
        let (head, body) = raw.split_once("\r\n\r\n").expect("head");
        assert!(head.contains(&format!("content-length: {}", body.len())));
        let v: serde_json::Value = serde_json::from_str(body).expect("json");
        assert_eq!(v["error"]["type"], "too_many_connections");
    }
}
