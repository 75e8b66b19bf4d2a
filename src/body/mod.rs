//! Response body type used by every handler: boxed so that JSON answers, pass-through
//! streams and PD streams share one type; and how a large body's bytes are handled without
//! holding the event loop: read on the blocking pool ([`off_loop`]), moved through sockets
//! a slice at a time ([`Pacer`]).

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full};

/// Errors a body can end with; ending with an error makes hyper cut the connection,
/// which is how a non-SSE response signals a broken upstream after headers.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub type RespBody = UnsyncBoxBody<Bytes, BoxError>;

pub fn full_body(b: impl Into<Bytes>) -> RespBody {
    Full::new(b.into())
        .map_err(|e: Infallible| match e {})
        .boxed_unsync()
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
    tokio::task::spawn_blocking(f).await.ok()
}

/// The most bytes a task moves through sockets (a request body read, a leg written) before
/// it lets the event loop run other tasks. A loopback or LAN socket takes megabytes per
/// call, and tokio's budget counts calls, not bytes: a maximum-size body was read, then
/// written to a leg, in runs of 10–20 ms of copying with no other request served (the
/// hostile bench's router-only probe). A yield per MiB costs about a microsecond.
pub const YIELD_EVERY_BYTES: usize = 1 << 20;

/// The most bytes a response body hands hyper before it lets the event loop run other
/// tasks (`pd::flight::PdBody`), and the most a stream's logprob merge writes at once
/// (`pd::sse::SseScanner::take_held`). hyper writes what a body yields, polling it again
/// while the client's socket takes the bytes (a loopback socket takes megabytes per call):
/// a stream whose events repeat a long prompt's input logprobs held the event loop for
/// milliseconds per read of its decode (the hostile bench's logprob bombs).
pub const SLICE_BYTES: usize = 256 << 10;

/// Counts the bytes a task moves and yields to the runtime every [`YIELD_EVERY_BYTES`].
#[derive(Debug, Default)]
pub struct Pacer {
    since: usize,
}

impl Pacer {
    /// `n` more bytes moved; yields when they add up to [`YIELD_EVERY_BYTES`].
    pub async fn moved(&mut self, n: usize) {
        self.since += n;
        if self.since >= YIELD_EVERY_BYTES {
            self.since = 0;
            tokio::task::yield_now().await;
        }
    }
}
