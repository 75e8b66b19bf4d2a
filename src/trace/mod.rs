//! OpenTelemetry traces, off by default (`[trace]`): one span tree per request, exported to
//! an OTLP collector, continuing the caller's W3C `traceparent` and handing one to each
//! engine leg (SGLang traces too, under pdgate's spans).
//!
//! The tree (names are stable; see docs/operations.md, "Traces"):
//!
//! ```text
//! POST /v1/chat/completions   SERVER  the request, until its response body ends
//! ├─ attempt                  one per attempt; `retry.reason` when it is a retry, and
//! │  │                        `error.type` when it failed
//! │  ├─ pick                  the pair chosen (worker ids, DP ranks; any wait for a
//! │  │                        decode slot)
//! │  ├─ bootstrap_check       the preflight of the prefill rank (instant when fresh)
//! │  ├─ prefill       CLIENT  the prefill leg, until the prefill answered
//! │  └─ decode_first_byte CLIENT  from sending the decode leg to its first event
//! └─ relay                    from decode's first event to the body's end
//! ```
//!
//! The prefill leg's `traceparent` names the `prefill` span as parent; the decode leg's the
//! `decode_first_byte` span. The caller's `tracestate` is forwarded unchanged.
//!
//! Why pdgate's own exporter: OTLP over HTTP with the JSON encoding (a stable part of the
//! OTLP specification that every collector's OTLP/HTTP receiver accepts: the
//! OpenTelemetry Collector on :4318, Jaeger, Tempo), sent with the hyper client pdgate
//! already has. The `opentelemetry-otlp` crates would bring tonic or reqwest and prost into
//! the build and the binary for a few hundred lines of encoding.
//!
//! Invariants:
//! - Off (the default), no [`Tracer`] exists: the request path pays one `Option` branch at
//!   the front door and one per stage, and allocates nothing.
//! - Sampling is parent-based: a caller's sampled flag decides; without a valid
//!   `traceparent` (absent or malformed: never an error to the client), a new trace is
//!   sampled with `trace.sample_ratio`, from the dispatcher's injectable randomness. An
//!   unsampled request makes no span and forwards the caller's headers as they came.
//! - A finished span goes to one bounded queue with `try_send`: a full queue drops it and
//!   counts it (`pdgate_trace_spans_dropped_total{why="queue_full"}`); a request never
//!   waits for the exporter, the collector, or a lock.
//! - A span is exported when it ends or is dropped (a cancelled leg's span ends where it
//!   was cancelled), exactly once.

pub mod context;
mod export;
pub mod otlp;

use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use rand::RngCore;
use tokio::sync::mpsc;

pub use context::{SpanId, TraceId, TraceParent, TRACEPARENT_LEN};
pub use export::{start, Exporter};
pub use otlp::{AttrValue, SpanData, SpanKind, SpanStatus};

/// The `traceparent` header's name.
pub const TRACEPARENT: &str = "traceparent";
/// The `tracestate` header's name.
pub const TRACESTATE: &str = "tracestate";

/// Spans exported and dropped since start (also in `/metrics`).
#[derive(Debug, Default)]
pub struct TraceStats {
    pub exported: AtomicU64,
    pub dropped: AtomicU64,
}

/// The handle that starts spans and queues them for export: cheap to clone (one `Arc`).
#[derive(Clone)]
pub struct Tracer(Arc<Inner>);

struct Inner {
    tx: mpsc::Sender<SpanData>,
    /// New traces are sampled when a draw from `u64` is below this.
    threshold: u64,
    sample_all: bool,
    /// Span ids: a SplitMix64 sequence from a random start (distinct, never zero).
    ids: AtomicU64,
    stats: Arc<TraceStats>,
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

fn splitmix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Tracer {
    fn new(tx: mpsc::Sender<SpanData>, sample_ratio: f64, stats: Arc<TraceStats>) -> Tracer {
        let ratio = sample_ratio.clamp(0.0, 1.0);
        Tracer(Arc::new(Inner {
            tx,
            threshold: (ratio * u64::MAX as f64) as u64,
            sample_all: ratio >= 1.0,
            ids: AtomicU64::new(rand::random()),
            stats,
        }))
    }

    pub fn stats(&self) -> &TraceStats {
        &self.0.stats
    }

    fn span_id(&self) -> SpanId {
        loop {
            let x = self
                .0
                .ids
                .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
            let id = splitmix(x);
            if id != 0 {
                return SpanId(id.to_be_bytes());
            }
        }
    }

    /// Queues a finished span; a full queue drops it (counted), never waits.
    fn submit(&self, data: SpanData) {
        if self.0.tx.try_send(data).is_err() {
            self.0.stats.dropped.fetch_add(1, Ordering::Relaxed);
            metrics::counter!(crate::telemetry::TRACE_SPANS_DROPPED, "why" => "queue_full")
                .increment(1);
        }
    }

    /// The request's span, when the request is traced: continuing the caller's
    /// `traceparent` when it is valid (and only if its sampled flag is set), else a new
    /// trace sampled with `trace.sample_ratio` (drawn from `rng`). `name` is the span's
    /// (`POST /v1/chat/completions`).
    pub fn start_request(
        &self,
        headers: &http::HeaderMap,
        name: Cow<'static, str>,
        rng: &mut dyn RngCore,
    ) -> Option<Box<RequestTrace>> {
        let parent = headers
            .get(TRACEPARENT)
            .and_then(|v| TraceParent::parse(v.as_bytes()));
        let (trace_id, parent_id, trace_state) = match parent {
            Some(p) if !p.sampled() => return None,
            Some(p) => {
                let state = headers
                    .get(TRACESTATE)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                (p.trace_id, Some(p.parent_id), state)
            }
            None => {
                if !self.0.sample_all && rng.next_u64() >= self.0.threshold {
                    return None;
                }
                let mut id = [0u8; 16];
                while id == [0; 16] {
                    rng.fill_bytes(&mut id);
                }
                (TraceId(id), None, None)
            }
        };
        let mut root = Span::new(self, trace_id, parent_id, name, SpanKind::Server);
        if let Some(d) = root.data.as_mut() {
            d.trace_state = trace_state;
        }
        Some(Box::new(RequestTrace { root, relay: None }))
    }
}

/// Where a child span hangs: a trace and its parent span.
#[derive(Clone)]
pub struct Scope {
    tracer: Tracer,
    trace_id: TraceId,
    parent: SpanId,
}

impl Scope {
    /// A span under this scope's parent, started now.
    pub fn child(&self, name: &'static str, kind: SpanKind) -> Span {
        Span::new(
            &self.tracer,
            self.trace_id,
            Some(self.parent),
            Cow::Borrowed(name),
            kind,
        )
    }

    pub fn trace_id(&self) -> TraceId {
        self.trace_id
    }
}

/// A span in progress: exported when it ends ([`Span::end`]) or is dropped.
pub struct Span {
    tracer: Tracer,
    data: Option<SpanData>,
}

impl Span {
    fn new(
        tracer: &Tracer,
        trace_id: TraceId,
        parent: Option<SpanId>,
        name: Cow<'static, str>,
        kind: SpanKind,
    ) -> Span {
        Span {
            data: Some(SpanData {
                trace_id,
                span_id: tracer.span_id(),
                parent,
                trace_state: None,
                name,
                kind,
                start: now_nanos(),
                end: 0,
                attrs: Vec::new(),
                status: SpanStatus::Unset,
            }),
            tracer: tracer.clone(),
        }
    }

    /// Children of this span go here.
    pub fn scope(&self) -> Option<Scope> {
        self.data.as_ref().map(|d| Scope {
            tracer: self.tracer.clone(),
            trace_id: d.trace_id,
            parent: d.span_id,
        })
    }

    pub fn set(&mut self, key: &'static str, value: impl Into<AttrValue>) {
        if let Some(d) = self.data.as_mut() {
            d.attrs.push((key, value.into()));
        }
    }

    /// Marks the span failed: `error.type` and an error status naming `why`.
    pub fn fail(&mut self, why: &'static str) {
        self.set("error.type", why);
        if let Some(d) = self.data.as_mut() {
            d.status = SpanStatus::Error(Cow::Borrowed(why));
        }
    }

    /// The `traceparent` an engine leg under this span carries (sampled).
    pub fn traceparent(&self) -> Option<[u8; TRACEPARENT_LEN]> {
        self.data.as_ref().map(|d| {
            TraceParent {
                trace_id: d.trace_id,
                parent_id: d.span_id,
                flags: 1,
            }
            .format()
        })
    }

    /// Ends the span now.
    pub fn end(self) {}
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some(mut d) = self.data.take() {
            d.end = now_nanos();
            self.tracer.submit(d);
        }
    }
}

/// A traced request: its span, and the relay's once decode's first event is in hand. It
/// rides on the request's record and ends with it ([`RequestTrace::finish`]).
pub struct RequestTrace {
    root: Span,
    relay: Option<Span>,
}

impl RequestTrace {
    /// Where the request's children hang.
    pub fn scope(&self) -> Option<Scope> {
        self.root.scope()
    }

    pub fn set(&mut self, key: &'static str, value: impl Into<AttrValue>) {
        self.root.set(key, value);
    }

    /// Decode's first event is in hand: the relay starts.
    pub fn relay_started(&mut self) {
        if self.relay.is_none() {
            self.relay = self
                .root
                .scope()
                .map(|s| s.child("relay", SpanKind::Internal));
        }
    }

    /// The response body ended: the relay and the request's span end, with the status
    /// sent and pdgate's outcome (`failure`: the reason, when it failed).
    pub fn finish(mut self, status: u16, failure: Option<&'static str>) {
        if let Some(mut relay) = self.relay.take() {
            if let Some(why) = failure {
                relay.fail(why);
            }
        }
        self.root
            .set("http.response.status_code", i64::from(status));
        self.root.set("pdgate.outcome", failure.unwrap_or("ok"));
        if let Some(why) = failure {
            self.root.fail(why);
        }
    }
}

impl std::fmt::Debug for RequestTrace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let id = self.root.data.as_ref().map(|d| (d.trace_id, d.span_id));
        f.debug_struct("RequestTrace").field("span", &id).finish()
    }
}

#[cfg(test)]
mod tests;
