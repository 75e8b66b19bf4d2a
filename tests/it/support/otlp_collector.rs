//! An in-process OTLP/HTTP collector: a hyper server on 127.0.0.1 port 0 that accepts
//! `POST /v1/traces` with the JSON encoding, parses it with serde_json and keeps the spans
//! (flattened, with their resource's `service.name`). It can be made slow (each export
//! answered after a delay), to show that pdgate's requests never wait for it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;

/// One span as the collector received it.
#[derive(Clone, Debug)]
pub struct Got {
    pub service: String,
    pub trace_id: String,
    pub span_id: String,
    pub parent: Option<String>,
    pub name: String,
    pub kind: i64,
    pub start: u64,
    pub end: u64,
    pub attrs: BTreeMap<String, Value>,
    pub status_code: i64,
    pub trace_state: Option<String>,
}

impl Got {
    /// An attribute's value as text (`stringValue`, `intValue`, `boolValue`).
    pub fn attr(&self, key: &str) -> Option<String> {
        let v = self.attrs.get(key)?;
        v.get("stringValue")
            .and_then(Value::as_str)
            .map(str::to_string)
            .or_else(|| {
                v.get("intValue")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .or_else(|| v.get("boolValue").map(|b| b.to_string()))
    }
}

#[derive(Clone, Default)]
pub struct Collector {
    pub spans: Arc<Mutex<Vec<Got>>>,
    /// Export requests received (well-formed or not).
    pub posts: Arc<Mutex<usize>>,
    /// Bodies that were not OTLP JSON as expected.
    pub bad: Arc<Mutex<Vec<String>>>,
    pub url: String,
    delay: Duration,
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

fn parse(body: &[u8]) -> Result<Vec<Got>, String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for rs in v["resourceSpans"].as_array().ok_or("no resourceSpans")? {
        let service = rs["resource"]["attributes"]
            .as_array()
            .ok_or("no resource attributes")?
            .iter()
            .find(|a| a["key"] == "service.name")
            .map(|a| text(&a["value"]["stringValue"]))
            .ok_or("no service.name")?;
        for ss in rs["scopeSpans"].as_array().ok_or("no scopeSpans")? {
            if ss["scope"]["name"].as_str().is_none() {
                return Err("no scope name".into());
            }
            for s in ss["spans"].as_array().ok_or("no spans")? {
                let num = |k: &str| -> Result<u64, String> {
                    s[k].as_str()
                        .and_then(|t| t.parse().ok())
                        .ok_or(format!("{k} is not a decimal string: {}", s[k]))
                };
                let attrs = s["attributes"]
                    .as_array()
                    .ok_or("no attributes")?
                    .iter()
                    .map(|a| (text(&a["key"]), a["value"].clone()))
                    .collect();
                let hex = |k: &str, len: usize| -> Result<String, String> {
                    let t = text(&s[k]);
                    let ok = t.len() == len
                        && t.chars()
                            .all(|c| c.is_ascii_digit() || ('a'..='f').contains(&c));
                    ok.then_some(t)
                        .ok_or(format!("{k} is not {len} hex digits"))
                };
                out.push(Got {
                    service: service.clone(),
                    trace_id: hex("traceId", 32)?,
                    span_id: hex("spanId", 16)?,
                    parent: match s.get("parentSpanId") {
                        Some(_) => Some(hex("parentSpanId", 16)?),
                        None => None,
                    },
                    name: text(&s["name"]),
                    kind: s["kind"].as_i64().ok_or("kind is not a number")?,
                    start: num("startTimeUnixNano")?,
                    end: num("endTimeUnixNano")?,
                    attrs,
                    status_code: s["status"]["code"].as_i64().unwrap_or(0),
                    trace_state: s.get("traceState").map(text),
                });
            }
        }
    }
    Ok(out)
}

impl Collector {
    /// A collector that answers each export after `delay`.
    pub async fn start(delay: Duration) -> Collector {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind collector");
        let mut c = Collector {
            url: format!("http://{}", l.local_addr().expect("addr")),
            delay,
            ..Collector::default()
        };
        c.delay = delay;
        let state = c.clone();
        tokio::spawn(async move {
            while let Ok((s, _)) = l.accept().await {
                let state = state.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| state.clone().handle(req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(s), svc)
                        .await;
                });
            }
        });
        c
    }

    async fn handle(self, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, hyper::Error> {
        let ok = req.method() == http::Method::POST
            && req.uri().path() == "/v1/traces"
            && req
                .headers()
                .get("content-type")
                .is_some_and(|v| v.as_bytes() == b"application/json");
        let body = req.into_body().collect().await?.to_bytes();
        *self.posts.lock().unwrap() += 1;
        if !self.delay.is_zero() {
            tokio::time::sleep(self.delay).await;
        }
        let status = match (ok, parse(&body)) {
            (true, Ok(spans)) => {
                self.spans.lock().unwrap().extend(spans);
                StatusCode::OK
            }
            (_, r) => {
                self.bad.lock().unwrap().push(format!("{r:?}"));
                StatusCode::BAD_REQUEST
            }
        };
        let mut r = Response::new(Full::new(Bytes::from_static(b"{}")));
        *r.status_mut() = status;
        Ok(r)
    }

    /// The spans of one trace received so far.
    pub fn trace(&self, trace_id: &str) -> Vec<Got> {
        self.spans
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace_id == trace_id)
            .cloned()
            .collect()
    }

    /// Waits (bounded: 10 s) until a trace has a span named `name`; its spans.
    pub async fn wait_for(&self, trace_id: &str, name: &str) -> Vec<Got> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let t = self.trace(trace_id);
            if t.iter().any(|s| s.name == name) {
                return t;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {name} span of trace {trace_id} within 10 s; got {t:?}, bad bodies {:?}",
                self.bad.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
