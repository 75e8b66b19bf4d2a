//! Finished spans and their OTLP/HTTP JSON encoding (the OTLP specification's JSON mapping of
//! `ExportTraceServiceRequest`): ids as lower-case hex, times as decimal strings of Unix
//! nanoseconds, `kind` and `status.code` as enum numbers, 64-bit integers as strings,
//! attributes as `{key, value: {stringValue | intValue | boolValue}}`.
//!
//! Invariant: one request body holds one resource (`service.name` and pdgate's version) and
//! one scope (`pdgate`); the encoding never fails (every value is a string, integer or
//! boolean pdgate made).

use std::borrow::Cow;

use serde_json::{json, Value as Json};

use super::context::{SpanId, TraceId};

/// What a span stands for (OTLP `Span.SpanKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
    Client = 3,
}

/// An attribute's value.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Str(Cow<'static, str>),
    Int(i64),
    Bool(bool),
}

impl From<&'static str> for AttrValue {
    fn from(s: &'static str) -> Self {
        AttrValue::Str(Cow::Borrowed(s))
    }
}
impl From<String> for AttrValue {
    fn from(s: String) -> Self {
        AttrValue::Str(Cow::Owned(s))
    }
}
impl From<i64> for AttrValue {
    fn from(v: i64) -> Self {
        AttrValue::Int(v)
    }
}
impl From<u64> for AttrValue {
    fn from(v: u64) -> Self {
        AttrValue::Int(i64::try_from(v).unwrap_or(i64::MAX))
    }
}
impl From<u32> for AttrValue {
    fn from(v: u32) -> Self {
        AttrValue::Int(i64::from(v))
    }
}
impl From<bool> for AttrValue {
    fn from(v: bool) -> Self {
        AttrValue::Bool(v)
    }
}

/// A span's status (OTLP `Status`): unset, or an error with its message.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum SpanStatus {
    #[default]
    Unset,
    Error(Cow<'static, str>),
}

/// A finished span, as it waits for export.
#[derive(Clone, Debug)]
pub struct SpanData {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent: Option<SpanId>,
    /// The caller's `tracestate`, on the request's span.
    pub trace_state: Option<String>,
    pub name: Cow<'static, str>,
    pub kind: SpanKind,
    /// Unix nanoseconds.
    pub start: u64,
    pub end: u64,
    pub attrs: Vec<(&'static str, AttrValue)>,
    pub status: SpanStatus,
}

fn attr(key: &str, v: &AttrValue) -> Json {
    let value = match v {
        AttrValue::Str(s) => json!({ "stringValue": s }),
        // int64 is a JSON string in protobuf's JSON mapping (collectors read both).
        AttrValue::Int(i) => json!({ "intValue": i.to_string() }),
        AttrValue::Bool(b) => json!({ "boolValue": b }),
    };
    json!({ "key": key, "value": value })
}

fn span(s: &SpanData) -> Json {
    let mut o = json!({
        "traceId": s.trace_id.hex(),
        "spanId": s.span_id.hex(),
        "name": s.name,
        "kind": s.kind as i64,
        "startTimeUnixNano": s.start.to_string(),
        "endTimeUnixNano": s.end.max(s.start).to_string(),
        "attributes": s.attrs.iter().map(|(k, v)| attr(k, v)).collect::<Vec<_>>(),
        "status": match &s.status {
            SpanStatus::Unset => json!({}),
            SpanStatus::Error(m) => json!({ "code": 2, "message": m }),
        },
    });
    if let Some(p) = s.parent {
        o["parentSpanId"] = Json::String(p.hex());
    }
    if let Some(ts) = &s.trace_state {
        o["traceState"] = Json::String(ts.clone());
    }
    o
}

/// The body of one export request (`POST /v1/traces`, `application/json`).
pub fn encode(service_name: &str, spans: &[SpanData]) -> Vec<u8> {
    let body = json!({
        "resourceSpans": [{
            "resource": {
                "attributes": [
                    attr("service.name", &AttrValue::Str(Cow::Owned(service_name.to_string()))),
                    attr("service.version", &AttrValue::Str(Cow::Borrowed(env!("CARGO_PKG_VERSION")))),
                ],
            },
            "scopeSpans": [{
                "scope": { "name": "pdgate", "version": env!("CARGO_PKG_VERSION") },
                "spans": spans.iter().map(span).collect::<Vec<_>>(),
            }],
        }],
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(parent: Option<SpanId>, status: SpanStatus) -> SpanData {
        SpanData {
            trace_id: TraceId([0xab; 16]),
            span_id: SpanId([1, 2, 3, 4, 5, 6, 7, 8]),
            parent,
            trace_state: None,
            name: Cow::Borrowed("prefill"),
            kind: SpanKind::Client,
            start: 1_700_000_000_000_000_001,
            end: 1_700_000_000_000_000_901,
            attrs: vec![
                ("pdgate.worker_id", AttrValue::Int(3)),
                ("server.address", "http://p:1".into()),
                ("pdgate.retried", AttrValue::Bool(true)),
            ],
            status,
        }
    }

    #[test]
    fn spans_encode_as_the_otlp_json_mapping() {
        let spans = [
            data(Some(SpanId([9; 8])), SpanStatus::Unset),
            data(None, SpanStatus::Error("prefill_status".into())),
        ];
        let body: Json = serde_json::from_slice(&encode("gate-a", &spans)).unwrap();
        let rs = &body["resourceSpans"][0];
        let res = &rs["resource"]["attributes"];
        assert_eq!(res[0]["key"], "service.name");
        assert_eq!(res[0]["value"]["stringValue"], "gate-a");
        let ss = &rs["scopeSpans"][0];
        assert_eq!(ss["scope"]["name"], "pdgate");
        let s = &ss["spans"][0];
        assert_eq!(s["traceId"], "ab".repeat(16));
        assert_eq!(s["spanId"], "0102030405060708");
        assert_eq!(s["parentSpanId"], "0909090909090909");
        assert_eq!(s["name"], "prefill");
        assert_eq!(s["kind"], 3);
        assert_eq!(s["startTimeUnixNano"], "1700000000000000001");
        assert_eq!(s["endTimeUnixNano"], "1700000000000000901");
        let attrs = s["attributes"].as_array().unwrap();
        assert_eq!(attrs[0]["key"], "pdgate.worker_id");
        assert_eq!(attrs[0]["value"]["intValue"], "3");
        assert_eq!(attrs[1]["value"]["stringValue"], "http://p:1");
        assert_eq!(attrs[2]["value"]["boolValue"], true);
        assert_eq!(s["status"], json!({}));
        let root = &ss["spans"][1];
        assert!(root.get("parentSpanId").is_none());
        assert_eq!(root["status"]["code"], 2);
        assert_eq!(root["status"]["message"], "prefill_status");
    }

    #[test]
    fn a_span_never_ends_before_it_starts() {
        let mut d = data(None, SpanStatus::Unset);
        d.end = d.start - 5;
        let body: Json = serde_json::from_slice(&encode("x", &[d.clone()])).unwrap();
        let s = &body["resourceSpans"][0]["scopeSpans"][0]["spans"][0];
        assert_eq!(s["endTimeUnixNano"], d.start.to_string());
    }
}
