//! The access log: one JSON object per line per request, on the `pdgate::access` tracing
//! target, written when the request's response ends (`log.access`, `--access-log`).
//!
//! Why a target of its own with a formatter of its own: the line must be one JSON object
//! whatever the main log format is. The request path serializes the whole line with serde
//! into a single field (`access`); [`layer`] writes that field as the line, prefixed with a
//! `timestamp` key, and nothing else (no level, no target, no ANSI colours). The main log
//! layer filters the target out ([`EXCLUDE`]), so the line is never written twice nor
//! wrapped in a text or JSON log line; and the access layer has its own filter, so
//! `log.level = "warn"` does not silence it.
//!
//! Invariants: a line is built only when the access log is on and a subscriber wants the
//! target; every key is always present (`null` when unknown), so each line has the same
//! shape.

use std::fmt;

use serde::Serialize;
use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// The tracing target of access lines.
pub const TARGET: &str = "pdgate::access";

/// The directive that keeps access lines out of the main log (added to its filter).
pub const EXCLUDE: &str = "pdgate::access=off";

/// The field that carries the serialized line.
const FIELD: &str = "access";

/// One request's access line. Times are milliseconds; `room` is a string because rooms
/// use 63 bits and log pipelines read JSON numbers as doubles (53 bits).
#[derive(Debug, Serialize)]
pub struct AccessLine<'a> {
    /// The client-visible id (`x-request-id`: the client's, or pdgate's own).
    pub request_id: &'a str,
    /// pdgate's internal id: legs carry `rid = pdg-<id>-<attempt><p|d>` to the engines.
    pub id: &'a str,
    pub route: &'a str,
    pub stream: Option<bool>,
    /// The status sent (for a stream that failed after its head: the head's 200); 499 when
    /// the client went away before any answer.
    pub status: u16,
    /// `null` on success, else the failure's error type (`client_disconnected` when the
    /// client went away, also mid-stream).
    pub fail_reason: Option<&'a str>,
    /// The last attempt's prefill worker (URL, its one name `prefill-N`) and DP rank.
    pub prefill: Option<&'a str>,
    pub prefill_id: Option<crate::types::WorkerIdent>,
    pub prefill_rank: Option<u32>,
    /// The decode (or regular) worker that answered, likewise.
    pub decode: Option<&'a str>,
    pub decode_id: Option<crate::types::WorkerIdent>,
    pub decode_rank: Option<u32>,
    /// The last attempt's (first) bootstrap room.
    pub room: Option<String>,
    /// Attempts dispatched (0: rejected before dispatch).
    pub attempts: u32,
    /// Times the stream was moved to another decode mid-stream (its prefill, decode and
    /// room are then the last pair's).
    pub moves: u32,
    /// Streams: arrival to the first event relayed.
    pub ttft_ms: Option<f64>,
    /// Arrival to the end of the response body.
    pub duration_ms: f64,
    /// The client API key's id, when keys are configured.
    pub key_id: Option<&'a str>,
    /// The model the request was routed to, while requests are routed by model.
    pub model: Option<&'a str>,
}

/// Whether an access line would be written now (some subscriber wants the target).
pub fn wanted() -> bool {
    tracing::enabled!(target: TARGET, Level::INFO)
}

impl AccessLine<'_> {
    /// Serializes the line and emits it on [`TARGET`].
    pub fn emit(&self) {
        match serde_json::to_string(self) {
            Ok(line) => tracing::info!(target: TARGET, access = line.as_str()),
            Err(e) => tracing::warn!(error = %e, "access line not serialized"),
        }
    }
}

/// Milliseconds, to the microsecond.
pub fn millis(d: std::time::Duration) -> f64 {
    d.as_micros() as f64 / 1000.0
}

/// The access log's layer: writes each access line to `writer`, one JSON object per line,
/// with a leading `timestamp` (RFC 3339, UTC).
pub fn layer<S, W>(writer: W) -> impl Layer<S>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    tracing_subscriber::fmt::layer()
        .with_ansi(false)
        .with_writer(writer)
        .event_format(LineFormat)
        .with_filter(Targets::new().with_target(TARGET, Level::INFO))
}

/// Writes the `access` field as the line.
struct LineFormat;

#[derive(Default)]
struct LineField(Option<String>);

impl Visit for LineField {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == FIELD {
            self.0 = Some(value.to_string());
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

impl<S, N> FormatEvent<S, N> for LineFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        _: &FmtContext<'_, S, N>,
        mut w: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut f = LineField::default();
        event.record(&mut f);
        // Only lines this module built: `{...}` objects.
        let Some(body) = f.0.as_deref().and_then(|l| l.strip_prefix('{')) else {
            return Ok(());
        };
        w.write_str("{\"timestamp\":\"")?;
        SystemTime.format_time(&mut w)?;
        w.write_str("\"")?;
        if body != "}" {
            w.write_char(',')?;
        }
        w.write_str(body)?;
        w.write_char('\n')
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn one_json_object_per_line_and_nothing_else() {
        let buf = Buf::default();
        let w = buf.clone();
        let sub = tracing_subscriber::registry().with(layer(move || w.clone()));
        tracing::subscriber::with_default(sub, || {
            assert!(wanted());
            tracing::info!("not an access line");
            AccessLine {
                request_id: "r\"1",
                id: "00ff",
                route: "generate",
                stream: Some(true),
                status: 200,
                fail_reason: None,
                prefill: Some("http://p:1"),
                prefill_id: Some(crate::types::WorkerIdent::new(
                    crate::types::Role::Prefill,
                    crate::types::WorkerId(3),
                )),
                prefill_rank: Some(1),
                decode: None,
                decode_id: None,
                decode_rank: None,
                room: Some(u64::MAX.to_string()),
                attempts: 1,
                moves: 0,
                ttft_ms: Some(1.5),
                duration_ms: 2.25,
                key_id: None,
                model: None,
            }
            .emit();
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1, "{text}");
        let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(v["request_id"], "r\"1");
        assert_eq!(v["room"], u64::MAX.to_string());
        assert!(v["decode"].is_null() && v["decode_id"].is_null());
        assert_eq!(v["prefill_id"], "prefill-3", "the worker's one name");
        assert!(v["timestamp"].as_str().unwrap().ends_with('Z'), "{v}");
    }
}
