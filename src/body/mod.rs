//! Response body type used by every handler: boxed so that JSON answers, pass-through
//! streams and PD streams share one type; and how a large body's bytes are handled without
//! holding the event loop: read on the blocking pool ([`off_loop`]), moved through sockets
//! a slice at a time ([`Pacer`], [`outflow`]).

use std::cell::Cell;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

pub mod outflow;
pub use outflow::{ByteRate, Outflow};

/// Errors a body can end with; ending with an error makes hyper cut the connection,
/// which is how a non-SSE response signals a broken upstream after headers.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub type RespBody = UnsyncBoxBody<Bytes, BoxError>;

pub fn full_body(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
}

/// A response body that holds `guard` until the body ends (its last frame) or is dropped:
/// what a request holds for its response's whole life (its record, accounted when it is
/// released; its connection's stream slot). The one pass-through body wrapper.
pub struct Guarded<G> {
    inner: RespBody,
    guard: Option<G>,
}

impl<G> Guarded<G> {
    pub fn new(inner: RespBody, guard: G) -> Guarded<G> {
        Guarded {
            inner,
            guard: Some(guard),
        }
    }
}

impl<G: Unpin> hyper::body::Body for Guarded<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        let r = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        if matches!(r, std::task::Poll::Ready(None)) || this.inner.is_end_stream() {
            this.guard = None;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// The `Content-Type` of JSON answers.
pub const JSON: &str = "application/json";

/// A whole answer: `status`, `Content-Type: content_type`, and `b` (every JSON, text and
/// `/metrics` answer pdgate writes itself is made here).
pub fn whole_response(
    status: http::StatusCode,
    content_type: &'static str,
    b: impl Into<Bytes>,
) -> http::Response<RespBody> {
    let mut r = http::Response::new(full_body(b));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(content_type),
    );
    r
}

/// Bodies of at least this many bytes are read (validated, parsed) on the blocking pool by
/// [`off_loop`]. Reading JSON runs at roughly a gigabyte a second, so a maximum-size request
/// body held the event loop, and every request on it, for tens of milliseconds
/// (`benches/hostile.rs`); below this size the hand-off would cost more than the read.
pub const OFF_LOOP_BYTES: usize = 256 << 10;

/// `f()`, which reads `len` bytes: inline below [`OFF_LOOP_BYTES`], else on the blocking
/// pool, so that the event loop keeps serving other requests meanwhile. `None` when the
/// pool could not run it (a panic in `f`, or the runtime shutting down).
pub async fn off_loop<T, F>(len: usize, f: F) -> Option<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    if len < OFF_LOOP_BYTES {
        return Some(f());
    }
    tokio::task::spawn_blocking(move || {
        demote_this_thread();
        f()
    })
    .await
    .ok()
}

/// Whether [`off_loop`]'s work runs at the OS's idle priority (`server.offload_idle_priority`,
/// set at start by `router::start_with`).
static OFFLOAD_IDLE: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// This thread's scheduling policy was already set (a blocking-pool thread only ever
    /// runs blocking work, so once is enough).
    static DEMOTED: Cell<bool> = const { Cell::new(false) };
}

/// Sets whether [`off_loop`]'s work runs at the OS's idle priority from now on (threads
/// already demoted stay so).
pub fn offload_idle_priority(on: bool) {
    OFFLOAD_IDLE.store(on, Ordering::Relaxed);
}

/// Puts the calling blocking-pool thread at `SCHED_IDLE` once, when configured: the event
/// loop preempts it as soon as it wakes, where a thread of normal priority keeps its CPU
/// for the rest of its time slice (milliseconds under Linux's EEVDF scheduler). Lowering
/// one's own priority needs no privilege; where the OS refuses, the work runs as before.
fn demote_this_thread() {
    if !OFFLOAD_IDLE.load(Ordering::Relaxed) || DEMOTED.get() {
        return;
    }
    DEMOTED.set(true);
    #[cfg(target_os = "linux")]
    {
        use thread_priority::unix::{
            set_thread_priority_and_policy, thread_native_id, NormalThreadSchedulePolicy,
            ThreadSchedulePolicy,
        };
        let idle = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
        if let Err(e) = set_thread_priority_and_policy(
            thread_native_id(),
            thread_priority::ThreadPriority::Min,
            idle,
        ) {
            tracing::debug!(error = ?e, "cannot run the blocking pool at idle priority");
        }
    }
}

/// The most bytes a task moves before it lets the event loop run other tasks: what a
/// response body hands hyper (`relay::body::PdBody`), what a stream's logprob merge writes at
/// once (`relay::sse::SseScanner::take_held`), one `writev` to a leg (`upstream::payload`), and
/// what a body read or a leg written moves between yields ([`Pacer`]). A loopback or LAN
/// socket takes megabytes per call, and tokio's budget counts calls, not bytes: a
/// maximum-size body was read, then written to a leg, in runs of 10–20 ms of copying with
/// no other request served, and a stream whose events repeat a long prompt's input logprobs
/// held the event loop for milliseconds per read of its decode (the hostile bench). A yield
/// costs about a microsecond, against ~50 µs or more of copying a slice.
pub const SLICE_BYTES: usize = 256 << 10;

/// Counts the bytes a task moves and yields to the runtime every [`SLICE_BYTES`]; with a
/// rate, the bytes past the first [`SLICE_BYTES`] also wait for it (a small body never
/// does).
#[derive(Debug, Default)]
pub struct Pacer<'a> {
    since: usize,
    total: usize,
    rate: Option<&'a ByteRate>,
}

impl<'a> Pacer<'a> {
    /// A pacer whose bytes past the first slice go at `rate`.
    pub fn with_rate(rate: Option<&'a ByteRate>) -> Pacer<'a> {
        Pacer {
            rate,
            ..Pacer::default()
        }
    }

    /// `n` more bytes moved; waits for the rate when past it, else yields when they add
    /// up to a slice.
    pub async fn moved(&mut self, n: usize) {
        let free = SLICE_BYTES.saturating_sub(self.total);
        self.total = self.total.saturating_add(n);
        self.since += n;
        if let Some(rate) = self.rate.filter(|_| n > free) {
            let wait = rate.reserve(n - free, tokio::time::Instant::now());
            if !wait.is_zero() {
                self.since = 0;
                tokio::time::sleep(wait).await;
                return;
            }
        }
        if self.since >= SLICE_BYTES {
            self.since = 0;
            tokio::task::yield_now().await;
        }
    }
}
