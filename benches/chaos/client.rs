//! The soak's load generator: open-loop lanes that send a mix of requests (`/generate`
//! and chat, streamed and not; a share whose prompt is longer than the engines' context, so
//! that the engines reject it with a 400; a share whose client goes away mid-request), each
//! under a client-side deadline derived from the router's timeouts, and the classification
//! of every answer.
//!
//! Why: "every request ended within its deadline, with a well-formed answer" is the soak's
//! first claim; it can only be checked from the client's side. Well-formed means: a 200
//! with a JSON body; a non-2xx with pdgate's JSON error (`{"error": {"type", ...}}`); or a
//! stream whose every event is JSON and which ends with `[DONE]` (an error event before it
//! is fine). Anything else (a cut, a stream without `[DONE]`, an error without JSON) is
//! counted as malformed; a request that did not end within its bound is counted as late.
//!
//! Bounded: every request has a timeout on its head and on each gap of its stream, every
//! lane ends when told to stop (or after `MAX_REQUESTS_PER_LANE`), holds at most
//! `MAX_OUTSTANDING` requests, and `stop` aborts a lane still busy after its bound.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::Value;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Idle connections the client keeps per host: bounded, so that the connections the
/// router holds open for it (hence its RSS) after the faults, when hangs have pushed the
/// concurrency up, compare with those after the warm-up.
const MAX_IDLE_PER_HOST: usize = 16;

/// A keep-alive HTTP/1.1 client with TCP_NODELAY.
pub fn http_client() -> HttpClient {
    let mut c = HttpConnector::new();
    c.set_nodelay(true);
    c.set_connect_timeout(Some(Duration::from_secs(2)));
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(MAX_IDLE_PER_HOST)
        .build(c)
}

/// GET `url` and read the body, within `within`.
pub async fn get(client: &HttpClient, url: &str, within: Duration) -> Option<(u16, Bytes)> {
    let req = http::Request::get(url).body(Full::new(Bytes::new())).ok()?;
    send(client, req, within).await
}

/// POST JSON to `url` and read the body, within `within`.
pub async fn post_json(
    client: &HttpClient,
    url: &str,
    body: &Value,
    within: Duration,
) -> Option<(u16, Bytes)> {
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .ok()?;
    send(client, req, within).await
}

async fn send(
    client: &HttpClient,
    req: http::Request<Full<Bytes>>,
    within: Duration,
) -> Option<(u16, Bytes)> {
    let fut = async {
        let resp = client.request(req).await.ok()?;
        let status = resp.status().as_u16();
        let body = resp.into_body().collect().await.ok()?.to_bytes();
        Some((status, body))
    };
    tokio::time::timeout(within, fut).await.ok().flatten()
}

/// The phases the tally splits requests by (the phase when a request started).
pub const PHASES: [&str; 3] = ["warm-up", "chaos", "after faults"];

/// Client-side bounds of one request.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// Until the response head, and for a non-streamed answer until its end.
    pub head: Duration,
    /// Longest silence inside a stream.
    pub gap: Duration,
}

/// What the clients send.
#[derive(Clone, Copy, Debug)]
pub struct Mix {
    /// Share of requests whose prompt is longer than the engines' context (→ 400).
    pub share_4xx: f64,
    /// Share of requests whose client goes away mid-request.
    pub share_disconnect: f64,
    /// Pause between two request starts of one lane.
    pub pause: Duration,
    /// Words in a too-long prompt (one token per word in the simulator).
    pub long_prompt_words: usize,
    /// Output tokens asked for.
    pub tokens: u32,
}

/// Upper bound on the requests of one lane (the stop flag normally ends it first).
const MAX_REQUESTS_PER_LANE: usize = 1_000_000;
/// Requests one lane may have in flight that it started in the current phase.
pub const MAX_OUTSTANDING: usize = 8;
/// At most this many bytes of an answer are kept for classification.
const MAX_KEPT: usize = 1 << 20;
/// Examples of bad answers kept for the report.
const MAX_SAMPLES: usize = 8;

#[derive(Clone, Copy, Debug)]
struct Spec {
    chat: bool,
    stream: bool,
    too_long: bool,
    disconnect: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bad {
    Late,
    Malformed,
    /// A too-long prompt that was answered 200 (the engines should have refused it).
    Unexpected,
}

struct Done {
    label: String,
    bad: Option<Bad>,
    head: Option<Duration>,
    total: Duration,
    max_gap: Duration,
    streamed: bool,
    /// The answer's `x-request-id` (to find the request in the router's log).
    request_id: Option<String>,
    /// When the request was sent.
    start: Instant,
}

/// A request lost to a stall or a mid-stream death: what it was, and when it ran (to set it
/// against the faults on at that time).
#[derive(Debug, Clone)]
pub struct Lost {
    pub label: String,
    pub phase: usize,
    pub start: Instant,
    pub end: Instant,
    pub request_id: Option<String>,
}

/// At most this many lost requests are kept with their times.
const MAX_LOST_KEPT: usize = 100_000;

/// The outcome label of a too-long prompt refused as it should be.
pub const TOO_LONG_REJECTED: &str = "400 rejected (too-long prompt, as asked)";
/// Suffix of the outcome label of a too-long prompt answered otherwise.
pub const TOO_LONG_OTHER: &str = " (too-long prompt)";

/// Error types that mean a request was lost to an engine that stalled (before or after its
/// first byte) or died mid-stream: what stall detection and stream moves exist to prevent.
pub const STALL_OR_MID_STREAM: &[&str] = &[
    "prefill_stalled",
    "decode_stalled",
    "prefill_timeout",
    "decode_first_byte_timeout",
    "decode_idle_timeout",
    "decode_broken",
];

/// Whether an outcome label names one of [`STALL_OR_MID_STREAM`].
pub fn lost_to_stall(label: &str) -> bool {
    // A stream that began and then ended with an error event was lost mid-stream,
    // whatever the reason its move failed with (e.g. `overloaded`).
    label.contains("stream + error event")
        || label
            .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|w| STALL_OR_MID_STREAM.contains(&w))
}

/// What the clients saw, by outcome and phase.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Outcome label → requests per phase.
    pub by_outcome: BTreeMap<String, [u64; 3]>,
    pub total: u64,
    /// Requests that failed because an engine stalled or died mid-stream.
    pub lost_to_stalls: u64,
    pub late: u64,
    pub malformed: u64,
    pub unexpected: u64,
    /// A few bad answers, for the report.
    pub samples: Vec<String>,
    /// A few requests lost to a stall or a mid-stream death, with their request ids.
    pub lost_samples: Vec<String>,
    /// Every request lost to a stall or a mid-stream death (up to [`MAX_LOST_KEPT`]).
    pub lost: Vec<Lost>,
    pub max_head: Duration,
    /// Longest non-streamed request, head to end.
    pub max_plain_total: Duration,
    pub max_gap: Duration,
    pub max_stream_total: Duration,
    /// Lanes still busy when stopped, past their bound (aborted).
    pub stuck_lanes: usize,
}

impl Tally {
    fn add(&mut self, phase: usize, d: Done) {
        self.by_outcome.entry(d.label.clone()).or_default()[phase.min(2)] += 1;
        self.total += 1;
        if lost_to_stall(&d.label) {
            self.lost_to_stalls += 1;
            if self.lost.len() < MAX_LOST_KEPT {
                self.lost.push(Lost {
                    label: d.label.clone(),
                    phase: phase.min(2),
                    start: d.start,
                    end: d.start + d.total,
                    request_id: d.request_id.clone(),
                });
            }
            if self.lost_samples.len() < MAX_SAMPLES {
                self.lost_samples.push(format!(
                    "{} ({} phase, after {:.0} ms, x-request-id {})",
                    d.label,
                    PHASES[phase.min(2)],
                    d.total.as_secs_f64() * 1000.0,
                    d.request_id.as_deref().unwrap_or("-")
                ));
            }
        }
        match d.bad {
            Some(Bad::Late) => self.late += 1,
            Some(Bad::Malformed) => self.malformed += 1,
            Some(Bad::Unexpected) => self.unexpected += 1,
            None => {}
        }
        if d.bad.is_some() && self.samples.len() < MAX_SAMPLES {
            self.samples.push(format!(
                "{} ({} phase, after {:.0} ms)",
                d.label,
                PHASES[phase.min(2)],
                d.total.as_secs_f64() * 1000.0
            ));
        }
        if let Some(h) = d.head {
            self.max_head = self.max_head.max(h);
        }
        if d.streamed {
            self.max_gap = self.max_gap.max(d.max_gap);
            self.max_stream_total = self.max_stream_total.max(d.total);
        } else if d.head.is_some() {
            self.max_plain_total = self.max_plain_total.max(d.total);
        }
    }
}

/// Running lanes of load.
pub struct Load {
    stop: Arc<AtomicBool>,
    phase: tokio::sync::watch::Sender<usize>,
    tally: Arc<Mutex<Tally>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    /// Starts `lanes` open-loop lanes against `base` (the router's `http://host:port`):
    /// each starts a request every `mix.pause` (±50 %) whether the previous ones ended or
    /// not, with at most [`MAX_OUTSTANDING`] in flight that it started in the current phase.
    /// Open loop, so that requests stuck on a hanging engine do not stop the traffic that
    /// the recovery check needs.
    pub fn start(
        client: &HttpClient,
        base: &str,
        lanes: usize,
        mix: Mix,
        bounds: Bounds,
        seed: u64,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let (phase, _) = tokio::sync::watch::channel(0usize);
        let tally = Arc::new(Mutex::new(Tally::default()));
        let tasks = (0..lanes)
            .map(|i| {
                let (client, base) = (client.clone(), Arc::<str>::from(base));
                let (stop, mut phase, tally) = (stop.clone(), phase.subscribe(), tally.clone());
                let mut rng = StdRng::seed_from_u64(seed.wrapping_add(i as u64 + 1));
                tokio::spawn(async move {
                    // Requests of the current phase, and those left over from earlier phases
                    // (which do not hold back the new phase's traffic: requests stuck on an
                    // engine that hung during the faults must not delay the recovery check).
                    let mut running = tokio::task::JoinSet::new();
                    let mut older = Vec::new();
                    let mut running_phase = 0;
                    for _ in 0..MAX_REQUESTS_PER_LANE {
                        // Stopped, or the `Load` is gone.
                        if stop.load(Ordering::Relaxed) || phase.has_changed().is_err() {
                            break;
                        }
                        let p = *phase.borrow_and_update();
                        if p != running_phase {
                            older.push(std::mem::take(&mut running));
                            running_phase = p;
                        }
                        for set in older.iter_mut().chain(std::iter::once(&mut running)) {
                            while set.try_join_next().is_some() {}
                        }
                        // Each request is bounded by its deadlines, so this wait is too; a new
                        // phase ends it at once (`changed` marks the phase seen, hence the flag).
                        let mut new_phase = !matches!(phase.has_changed(), Ok(false));
                        while running.len() >= MAX_OUTSTANDING && !new_phase {
                            tokio::select! {
                                _ = running.join_next() => {}
                                _ = phase.changed() => new_phase = true,
                            }
                        }
                        if new_phase {
                            continue;
                        }
                        let spec = pick(&mut rng, &mix);
                        let cut_after = Duration::from_millis(rng.random_range(1..=20));
                        let (client, base, tally) = (client.clone(), base.clone(), tally.clone());
                        running.spawn(async move {
                            let d = one(&client, &base, spec, &mix, bounds, cut_after).await;
                            if let Ok(mut t) = tally.lock() {
                                t.add(p, d);
                            }
                        });
                        let jitter = rng.random_range(0.5..1.5);
                        tokio::time::sleep(mix.pause.mul_f64(jitter)).await;
                    }
                    for mut set in older.into_iter().chain(std::iter::once(running)) {
                        while set.join_next().await.is_some() {}
                    }
                })
            })
            .collect();
        Load {
            stop,
            phase,
            tally,
            tasks,
        }
    }

    /// Requests started from now on count in `phase` (an index of [`PHASES`]).
    pub fn set_phase(&self, phase: usize) {
        self.phase.send_replace(phase);
    }

    /// A copy of the tally so far.
    pub fn tally(&self) -> Tally {
        self.tally.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Stops the lanes: each waits for its requests (bounded by `within`, then aborted).
    pub async fn stop(mut self, within: Duration) -> Tally {
        self.stop.store(true, Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + within;
        let mut stuck = 0;
        for mut t in std::mem::take(&mut self.tasks) {
            if tokio::time::timeout_at(deadline, &mut t).await.is_err() {
                t.abort();
                stuck += 1;
            }
        }
        let mut tally = self.tally.lock().map(|t| t.clone()).unwrap_or_default();
        tally.stuck_lanes = stuck;
        tally
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn pick(rng: &mut StdRng, mix: &Mix) -> Spec {
    let too_long = rng.random_bool(mix.share_4xx.clamp(0.0, 1.0));
    Spec {
        chat: rng.random_bool(0.5),
        stream: rng.random_bool(0.5),
        too_long,
        disconnect: !too_long && rng.random_bool(mix.share_disconnect.clamp(0.0, 1.0)),
    }
}

fn body(spec: Spec, mix: &Mix) -> (&'static str, String) {
    let prompt = if spec.too_long {
        "w ".repeat(mix.long_prompt_words)
    } else {
        "The capital of France is".to_string()
    };
    let (stream, t) = (spec.stream, mix.tokens);
    if spec.chat {
        let v = serde_json::json!({
            "model": "sim-model",
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": t,
            "stream": stream,
        });
        ("/v1/chat/completions", v.to_string())
    } else {
        let v = serde_json::json!({
            "text": prompt,
            "sampling_params": {"max_new_tokens": t},
            "stream": stream,
        });
        ("/generate", v.to_string())
    }
}

fn done(label: impl Into<String>, bad: Option<Bad>, t0: Instant) -> Done {
    Done {
        label: label.into(),
        bad,
        head: None,
        total: t0.elapsed(),
        max_gap: Duration::ZERO,
        streamed: false,
        request_id: None,
        start: t0,
    }
}

/// Sends one request and reads (or drops) its answer.
async fn one(
    client: &HttpClient,
    base: &str,
    spec: Spec,
    mix: &Mix,
    b: Bounds,
    cut_after: Duration,
) -> Done {
    let (path, json) = body(spec, mix);
    let t0 = Instant::now();
    let req = match http::Request::post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(json)))
    {
        Ok(r) => r,
        Err(e) => {
            return done(
                format!("malformed: request not built ({e})"),
                Some(Bad::Malformed),
                t0,
            )
        }
    };
    let exchange = exchange(client, req, spec, b, t0);
    if spec.disconnect && !spec.stream {
        // Goes away after a few ms, usually before the answer.
        return match tokio::time::timeout(cut_after, exchange).await {
            Ok(d) => d,
            Err(_) => done("client went away (before the answer)", None, t0),
        };
    }
    exchange.await
}

async fn exchange(
    client: &HttpClient,
    req: http::Request<Full<Bytes>>,
    spec: Spec,
    b: Bounds,
    t0: Instant,
) -> Done {
    let resp = match tokio::time::timeout(b.head, client.request(req)).await {
        Err(_) => return done("late: no response head in time", Some(Bad::Late), t0),
        Ok(Err(e)) => {
            let what = if e.is_connect() {
                "connect failed"
            } else {
                "no answer"
            };
            return done(format!("malformed: {what}"), Some(Bad::Malformed), t0);
        }
        Ok(Ok(r)) => r,
    };
    let head = t0.elapsed();
    let status = resp.status().as_u16();
    let request_id = resp
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let sse = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    let mut body = resp.into_body();
    let mut kept: Vec<u8> = Vec::new();
    if !sse {
        let left = b.head.saturating_sub(t0.elapsed());
        let d = match tokio::time::timeout(left, body.collect()).await {
            Err(_) => done("late: body not complete in time", Some(Bad::Late), t0),
            Ok(Err(_)) => done(
                format!("malformed: {status} answer cut"),
                Some(Bad::Malformed),
                t0,
            ),
            Ok(Ok(c)) => {
                let (label, bad) = classify_json(status, &c.to_bytes(), spec);
                done(label, bad, t0)
            }
        };
        return Done {
            head: Some(head),
            request_id,
            ..d
        };
    }
    let mut last = Instant::now();
    let mut max_gap = Duration::ZERO;
    let mut out = loop {
        let frame = match tokio::time::timeout(b.gap, body.frame()).await {
            Err(_) => break done("late: stream silent too long", Some(Bad::Late), t0),
            Ok(None) => {
                let (label, bad) = classify_sse(&kept, spec);
                break done(label, bad, t0);
            }
            Ok(Some(Err(_))) => break done("malformed: stream cut", Some(Bad::Malformed), t0),
            Ok(Some(Ok(f))) => f,
        };
        max_gap = max_gap.max(last.elapsed());
        last = Instant::now();
        if let Ok(data) = frame.into_data() {
            if kept.len() + data.len() <= MAX_KEPT {
                kept.extend_from_slice(&data);
            }
            if spec.disconnect {
                break done("client went away (mid-stream)", None, t0);
            }
        }
    };
    out.head = Some(head);
    out.request_id = request_id;
    out.max_gap = max_gap;
    out.streamed = true;
    out
}

fn error_type(v: &Value) -> Option<&str> {
    v.get("error")?.get("type")?.as_str()
}

/// A non-streamed answer: a 200 with a JSON body, or a JSON error.
fn classify_json(status: u16, body: &[u8], spec: Spec) -> (String, Option<Bad>) {
    let v: Option<Value> = serde_json::from_slice(body).ok();
    match (status, v) {
        (200, Some(_)) if spec.too_long => (
            "unexpected: 200 for a too-long prompt".into(),
            Some(Bad::Unexpected),
        ),
        (200, Some(_)) => ("200".into(), None),
        (200, None) => ("malformed: 200 without JSON".into(), Some(Bad::Malformed)),
        (s, Some(v)) => match error_type(&v) {
            Some(t) if spec.too_long && s == 400 && t.ends_with("_rejected") => {
                (TOO_LONG_REJECTED.into(), None)
            }
            Some(t) if spec.too_long => (format!("{s} {t}{TOO_LONG_OTHER}"), None),
            Some(t) => (format!("{s} {t}"), None),
            None => (
                format!("malformed: {s} without a JSON error"),
                Some(Bad::Malformed),
            ),
        },
        (s, None) => (
            format!("malformed: {s} without a JSON error"),
            Some(Bad::Malformed),
        ),
    }
}

/// A streamed answer: JSON events, maybe one error event, then `[DONE]` last.
fn classify_sse(body: &[u8], spec: Spec) -> (String, Option<Bad>) {
    let Ok(text) = std::str::from_utf8(body) else {
        return ("malformed: stream not UTF-8".into(), Some(Bad::Malformed));
    };
    let text = text.replace("\r\n", "\n");
    let mut done = false;
    let mut error: Option<String> = None;
    for ev in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data: String = ev
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim)
            .collect();
        if done {
            return ("malformed: event after [DONE]".into(), Some(Bad::Malformed));
        }
        if data == "[DONE]" {
            done = true;
            continue;
        }
        match serde_json::from_str::<Value>(&data) {
            Ok(v) if v.get("error").is_some() => {
                error = Some(error_type(&v).unwrap_or("untyped").to_string());
            }
            Ok(_) => {}
            Err(_) => return ("malformed: SSE event not JSON".into(), Some(Bad::Malformed)),
        }
    }
    match (done, error) {
        (false, _) => (
            "malformed: stream without [DONE]".into(),
            Some(Bad::Malformed),
        ),
        (true, Some(t)) => (format!("200 stream + error event ({t})"), None),
        (true, None) if spec.too_long => (
            "unexpected: 200 stream for a too-long prompt".into(),
            Some(Bad::Unexpected),
        ),
        (true, None) => ("200 stream".into(), None),
    }
}
