//! The access log (`log.access`): one JSON object per line per request, written when the
//! response ends — served, rejected before dispatch, failed mid-stream, or abandoned by the
//! client — with the request's route, status, failure reason, legs, room, attempts and
//! timings.
//!
//! The in-process tests capture the access layer's output with a subscriber of their own,
//! set for the test's runtime (`support::rt::set_default`: every thread the router's tasks
//! run on logs through it). The last test runs the binary with a text main log.

use crate::support::common::{self, start, Env, GEN, GEN_STREAM};

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http_body_util::BodyExt;
use pdgate::telemetry::access;
use pdgate_sim::{EngineConfig, Faults};
use serde_json::Value;
use tracing_subscriber::layer::SubscriberExt;

/// What the access layer wrote.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    /// Routes the test's access lines here until the guard drops.
    fn install(&self) -> crate::support::rt::LogGuard {
        let w = self.clone();
        let sub = tracing_subscriber::registry().with(access::layer(move || w.clone()));
        crate::support::rt::set_default(sub)
    }

    /// Every line, each of which must be one JSON object.
    fn lines(&self) -> Vec<Value> {
        let text = String::from_utf8(self.0.lock().unwrap().clone()).unwrap();
        assert!(text.is_empty() || text.ends_with('\n'), "{text}");
        text.lines()
            .map(|l| {
                let v: Value =
                    serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
                assert!(v.is_object(), "{l}");
                v
            })
            .collect()
    }

    /// The one line of request `rid` (bounded wait: a body ends after the client read it).
    async fn line_for(&self, rid: &str) -> Value {
        for _ in 0..500 {
            let mut mine: Vec<Value> = self
                .lines()
                .into_iter()
                .filter(|v| v["request_id"] == rid)
                .collect();
            if let Some(v) = mine.pop() {
                assert!(mine.is_empty(), "more than one line for {rid}");
                return v;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("no access line for {rid}: {:?}", self.lines());
    }

    /// Every request id logged once and only once.
    fn assert_once_each(&self, rids: &[&str]) {
        let lines = self.lines();
        for rid in rids {
            let n = lines.iter().filter(|v| v["request_id"] == *rid).count();
            assert_eq!(n, 1, "{rid}: {n} lines in {lines:?}");
        }
    }
}

/// Sends a request with `x-request-id: rid`; the status and the whole body.
async fn send(
    env: &Env,
    rid: &str,
    method: &str,
    path: &str,
    ct: &str,
    body: &str,
) -> (u16, String) {
    let mut headers = vec![("x-request-id", rid)];
    if !ct.is_empty() {
        headers.push(("content-type", ct));
    }
    let resp = env.send(method, path, &headers, body.to_string()).await;
    let status = resp.status().as_u16();
    let bytes = tokio::time::timeout(Duration::from_secs(20), resp.into_body().collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// A request: id, method, path, content type, body.
type Req<'a> = (&'a str, &'a str, &'a str, &'a str, &'a str);
/// What its line says: status, route, fail reason, stream (`None`: not dispatched).
type Want<'a> = (u16, &'a str, Option<&'a str>, Option<bool>);

/// The keys every line has, whatever happened.
const KEYS: [&str; 19] = [
    "request_id",
    "id",
    "route",
    "stream",
    "status",
    "fail_reason",
    "prefill",
    "prefill_id",
    "prefill_rank",
    "decode",
    "decode_id",
    "decode_rank",
    "room",
    "attempts",
    "ttft_ms",
    "duration_ms",
    "key_id",
    "model",
    "timestamp",
];

fn assert_shape(v: &Value) {
    for k in KEYS {
        assert!(v.get(k).is_some(), "no {k} in {v}");
    }
    let id = v["id"].as_str().unwrap();
    assert!(
        id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()),
        "{v}"
    );
    assert!(v["duration_ms"].as_f64().unwrap() >= 0.0, "{v}");
    assert!(v["key_id"].is_null(), "{v}");
    if let Some(t) = v["ttft_ms"].as_f64() {
        assert!(t <= v["duration_ms"].as_f64().unwrap(), "{v}");
    }
}

/// The legs of a dispatched request: this cluster's workers, and a room on the prefill's
/// rank (`room % dp == rank`).
fn assert_legs(v: &Value, env: &Env, prefill_dp: u64) {
    assert_eq!(v["prefill"], env.cluster.prefills[0].url(), "{v}");
    assert_eq!(v["decode"], env.cluster.decodes[0].url(), "{v}");
    let rank = v["prefill_rank"].as_u64().unwrap();
    assert!(rank < prefill_dp, "{v}");
    assert_eq!(v["decode_rank"], 0, "{v}");
    assert_eq!(v["decode_id"], "decode-0", "the decode's one name: {v}");
    assert_eq!(v["prefill_id"], "prefill-0", "the prefill's one name: {v}");
    let room: u64 = v["room"].as_str().unwrap().parse().unwrap();
    assert_eq!(room % prefill_dp, rank, "{v}");
}

#[tokio::test(crate = "crate::support::rt")]
async fn one_line_per_request_served_or_rejected() {
    let cap = Capture::default();
    let _guard = cap.install();
    let env = start(
        vec![EngineConfig::prefill(2)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.log.access = true;
            c.server.max_body_bytes = 4096;
            c.server.public_metrics = true;
        },
    )
    .await;
    env.wait_routable(2, 1).await;
    let chat =
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":2,"stream":true}"#;
    let big = format!(r#"{{"text":"{}"}}"#, "a".repeat(5000));
    const JSON: &str = "application/json";
    // (request id, method, path, content type, body), then what the line must say.
    #[rustfmt::skip]
    let cases: Vec<(Req, Want)> = vec![
        (("a-ok", "POST", "/generate", JSON, GEN), (200, "generate", None, Some(false))),
        (("a-stream", "POST", "/generate", JSON, GEN_STREAM), (200, "generate", None, Some(true))),
        (("a-chat", "POST", "/v1/chat/completions", JSON, chat), (200, "chat_completions", None, Some(true))),
        (("a-json", "POST", "/generate", JSON, "{x"), (400, "generate", Some("invalid_request"), None)),
        (("a-type", "POST", "/generate", "text/plain", GEN), (415, "generate", Some("unsupported_media_type"), None)),
        (("a-big", "POST", "/generate", JSON, &big), (413, "generate", Some("payload_too_large"), None)),
        (("a-method", "GET", "/generate", "", ""), (405, "generate", Some("method_not_allowed"), None)),
        (("a-404", "GET", "/nowhere", "", ""), (404, "unmatched", Some("not_found"), None)),
        (("a-health", "GET", "/health", "", ""), (200, "health", None, None)),
        (("a-metrics", "GET", "/metrics", "", ""), (200, "metrics", None, None)),
    ];
    for ((rid, method, path, ct, body), (status, route, reason, stream)) in &cases {
        let (st, text) = send(&env, rid, method, path, ct, body).await;
        assert_eq!(st, *status, "{rid}: {text}");
        let v = cap.line_for(rid).await;
        assert_shape(&v);
        assert_eq!(v["status"], *status, "{v}");
        assert_eq!(v["route"], *route, "{v}");
        assert_eq!(v["fail_reason"].as_str(), *reason, "{v}");
        assert_eq!(v["stream"].as_bool(), *stream, "{v}");
        let dispatched = stream.is_some();
        assert_eq!(v["attempts"], u32::from(dispatched), "{v}");
        if dispatched {
            assert_legs(&v, &env, 2);
        } else {
            for k in ["prefill", "prefill_rank", "decode", "decode_rank", "room"] {
                assert!(v[k].is_null(), "{k} in {v}");
            }
        }
        assert_eq!(v["ttft_ms"].is_number(), *stream == Some(true), "{v}");
    }
    env.settled_stats().await;
    let rids: Vec<&str> = cases.iter().map(|c| c.0 .0).collect();
    cap.assert_once_each(&rids);
}

/// Without `log.access` nothing is written, even with a subscriber that wants the target.
#[tokio::test(crate = "crate::support::rt")]
async fn off_unless_enabled() {
    let cap = Capture::default();
    let _guard = cap.install();
    let env = common::start_pair().await;
    for (rid, body) in [("o-ok", GEN), ("o-bad", "{x")] {
        send(&env, rid, "POST", "/generate", "application/json", body).await;
    }
    send(&env, "o-health", "GET", "/health", "", "").await;
    env.settled_stats().await;
    assert!(cap.lines().is_empty(), "{:?}", cap.lines());
}

#[tokio::test(crate = "crate::support::rt")]
async fn failed_mid_stream_and_abandoned_requests() {
    let cap = Capture::default();
    let _guard = cap.install();
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| c.log.access = true,
    )
    .await;
    env.wait_routable(1, 1).await;
    let decode = &env.cluster.decodes[0];

    // The decode dies after its first chunk: the stream ends with an error event; the line
    // has the head's 200 and the failure.
    decode.set_faults(Faults {
        decode_die_mid_stream_after: Some(1),
        ..Faults::default()
    });
    let (st, body) = send(
        &env,
        "b-cut",
        "POST",
        "/generate",
        "application/json",
        GEN_STREAM,
    )
    .await;
    assert_eq!(st, 200);
    assert!(body.contains("\"error\""), "{body}");
    let v = cap.line_for("b-cut").await;
    assert_shape(&v);
    assert_eq!(
        (v["status"].as_u64(), v["attempts"].as_u64()),
        (Some(200), Some(1)),
        "{v}"
    );
    let reason = v["fail_reason"].as_str().expect("a failure");
    assert!(reason.starts_with("decode_"), "{v}");
    assert!(v["ttft_ms"].is_number(), "{v}");
    assert_legs(&v, &env, 1);

    // The client reads one event and goes away.
    decode.set_faults(Faults {
        decode_extra_itl_ms: 300,
        ..Faults::default()
    });
    let resp = env
        .send(
            "POST",
            "/generate",
            &[
                ("content-type", "application/json"),
                ("x-request-id", "b-gone"),
            ],
            r#"{"text":"a","sampling_params":{"max_new_tokens":50},"stream":true}"#,
        )
        .await;
    assert_eq!(resp.status(), 200);
    let mut b = resp.into_body();
    let first = tokio::time::timeout(Duration::from_secs(10), b.frame()).await;
    assert!(matches!(first, Ok(Some(Ok(_)))), "no first event");
    drop(b);
    let v = cap.line_for("b-gone").await;
    assert_shape(&v);
    assert_eq!(v["status"], 200, "{v}");
    assert_eq!(v["fail_reason"], "client_disconnected", "{v}");
    assert!(v["ttft_ms"].is_number(), "{v}");
    decode.set_faults(Faults::default());
    env.settled_stats().await;
    cap.assert_once_each(&["b-cut", "b-gone"]);
}

#[tokio::test(crate = "crate::support::rt")]
async fn shed_and_gone_before_the_answer() {
    let cap = Capture::default();
    let _guard = cap.install();
    let hang = Faults {
        prefill_hang: true,
        ..Faults::default()
    };
    let env = Arc::new(
        start(
            vec![common::with_faults(EngineConfig::prefill(1), hang)],
            vec![EngineConfig::decode(1)],
            |c| {
                c.log.access = true;
                c.admission.max_in_flight = 1;
                c.admission.max_queue = 0;
            },
        )
        .await,
    );
    env.wait_routable(1, 1).await;
    // One request takes the only slot and hangs in the prefill...
    let e = env.clone();
    let held = tokio::spawn(async move {
        send(&e, "c-gone", "POST", "/generate", "application/json", GEN).await
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.cluster.prefills[0].stats().held_now < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the prefill never got the leg"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...so the next is shed at once (no queue).
    let (st, _) = send(&env, "c-shed", "POST", "/generate", "application/json", GEN).await;
    assert_eq!(st, 429);
    let v = cap.line_for("c-shed").await;
    assert_shape(&v);
    assert_eq!(v["fail_reason"], "overloaded", "{v}");
    assert_eq!(v["attempts"], 0, "{v}");
    // The held one's client goes away before any answer: 499.
    held.abort();
    let v = cap.line_for("c-gone").await;
    assert_shape(&v);
    assert_eq!(v["status"], 499, "{v}");
    assert_eq!(v["fail_reason"], "client_disconnected", "{v}");
    assert_eq!(v["attempts"], 1, "{v}");
    assert_eq!(v["prefill"], env.cluster.prefills[0].url(), "{v}");
    assert!(v["ttft_ms"].is_null(), "{v}");
    env.settled_stats().await;
    cap.assert_once_each(&["c-gone", "c-shed"]);
}

/// `s` without terminal colour codes (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The binary with a text main log, filtered at `warn`: access lines are still written, each
/// a JSON object on a line of its own, and only once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_writes_json_lines_under_a_text_log() {
    let cluster = pdgate_sim::SimCluster::spawn(
        &[common::fast_engine(EngineConfig::prefill(1))],
        &[common::fast_engine(EngineConfig::decode(1))],
    )
    .await
    .unwrap();
    let p = &cluster.prefills[0];
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdgate"))
        // The admin listener on a free port too (its default, 29000, may be taken by
        // another router on this machine: the binary then exits before it listens).
        .args(["serve", "--port", "0", "--admin-port", "0", "--access-log"])
        .args(["--log-level", "warn,pdgate::router=info"])
        .args(["--health-check-interval-secs", "0.05"])
        .args([
            "--prefill",
            &p.url(),
            &p.bootstrap_port().unwrap().to_string(),
        ])
        .args(["--decode", &cluster.decodes[0].url()])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("pdgate binary");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut seen: Vec<String> = Vec::new();
    // The text line `... pdgate listening url=http://...`.
    let url = loop {
        let line = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("pdgate never said it listens");
        let line = strip_ansi(&line);
        seen.push(line.clone());
        if let Some(i) = line.find("url=") {
            break line[i + 4..].split_whitespace().next().unwrap().to_string();
        }
    };
    assert!(serde_json::from_str::<Value>(&seen[seen.len() - 1]).is_err());
    let client = common::client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let req = http::Request::get(format!("{url}/readiness"))
            .body(http_body_util::Full::new(bytes::Bytes::new()))
            .unwrap();
        if client.request(req).await.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "router never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for (rid, body) in [("d-gen", GEN), ("d-bad", "{x")] {
        let req = http::Request::post(format!("{url}/generate"))
            .header("content-type", "application/json")
            .header("x-request-id", rid)
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .unwrap();
        let resp = client.request(req).await.unwrap();
        resp.into_body().collect().await.unwrap();
    }
    let mut found: Vec<Value> = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while found.len() < 2 && std::time::Instant::now() < deadline {
        let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) else {
            continue;
        };
        if line.starts_with('{') {
            let v: Value =
                serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
            assert!(
                v.get("level").is_none(),
                "a log line, not an access line: {line}"
            );
            if v["request_id"] == "d-gen" || v["request_id"] == "d-bad" {
                found.push(v);
            }
        } else {
            assert!(
                !line.contains("d-gen"),
                "access data in a text line: {line}"
            );
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(found.len(), 2, "{found:?}");
    let by = |rid: &str| {
        found
            .iter()
            .find(|v| v["request_id"] == rid)
            .cloned()
            .unwrap()
    };
    let gen = by("d-gen");
    assert_shape(&gen);
    assert_eq!(
        (gen["status"].as_u64(), gen["route"].as_str()),
        (Some(200), Some("generate"))
    );
    assert_eq!(gen["prefill"], p.url());
    let bad = by("d-bad");
    assert_eq!(bad["status"], 400);
    assert_eq!(bad["fail_reason"], "invalid_request");
}

/// A stdout nobody reads must not stall requests: the log writer drops and counts lines
/// once its buffer is full, rather than block the runtime on a full pipe.
#[tokio::test(crate = "crate::support::rt")]
async fn a_stalled_stdout_drops_log_lines_and_never_blocks_requests() {
    let cluster = pdgate_sim::SimCluster::spawn(
        &[common::fast_engine(EngineConfig::prefill(1))],
        &[common::fast_engine(EngineConfig::decode(1))],
    )
    .await
    .unwrap();
    let p = &cluster.prefills[0];
    let dir = std::env::temp_dir().join(format!("pdgate-log-stall-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("pdgate.toml");
    std::fs::write(
        &cfg,
        "[log]\nformat = \"json\"\naccess = true\nbuffer_lines = 16\n[health]\ninterval_secs = 0.05\n",
    )
    .unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_pdgate"))
        .args(["serve", "--port", "0", "--admin-port", "0", "--config"])
        .arg(&cfg)
        .args([
            "--prefill",
            &p.url(),
            &p.bootstrap_port().unwrap().to_string(),
        ])
        .args(["--decode", &cluster.decodes[0].url()])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("pdgate binary");
    // Read until both listeners are up, then stop reading (the pipe stays open).
    let stdout = child.stdout.take().unwrap();
    let (url, admin, _pipe) = tokio::task::spawn_blocking(move || {
        let mut r = BufReader::new(stdout);
        let (mut url, mut admin) = (None, None);
        let mut line = String::new();
        while url.is_none() || admin.is_none() {
            line.clear();
            if r.read_line(&mut line).unwrap_or(0) == 0 {
                break;
            }
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                let u = v["url"].as_str().map(str::to_string);
                match v["message"].as_str() {
                    Some("pdgate listening") => url = u,
                    Some("admin API listening") => admin = u,
                    _ => {}
                }
            }
        }
        (url.expect("front door url"), admin.expect("admin url"), r)
    })
    .await
    .unwrap();
    let client = common::client();
    let send = |uri: String, body: Option<&'static str>| {
        let client = client.clone();
        async move {
            let req = match body {
                Some(b) => http::Request::post(uri)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(bytes::Bytes::from(b))),
                None => {
                    http::Request::get(uri).body(http_body_util::Full::new(bytes::Bytes::new()))
                }
            }
            .unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
                .await
                .expect("answered: logging must not block the router")
                .expect("response");
            let status = resp.status();
            let body = resp.into_body().collect().await.expect("body").to_bytes();
            (status, body)
        }
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while send(format!("{url}/readiness"), None).await.0 != 200 {
        assert!(tokio::time::Instant::now() < deadline, "router never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Each request writes an access-log line (~0.5 KB): far more than the pipe (64 KiB)
    // and the 16-line buffer hold.
    for i in 0..250 {
        let (st, _) = send(format!("{url}/generate"), Some(GEN)).await;
        assert_eq!(st, 200, "request {i}");
    }
    // The drops are counted (published once a second).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (_, body) = send(format!("{admin}/metrics"), None).await;
        let text = String::from_utf8_lossy(&body).to_string();
        let dropped = text
            .lines()
            .find(|l| l.starts_with("pdgate_log_lines_dropped_total"))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        if dropped > 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no dropped log line counted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A request refused (429) because its client key is over its in-flight limit names the
/// key: the access line's `key_id`, and `pdgate_client_requests_total{key}` (a key name no
/// other test uses, so its count is exact though the recorder is process-wide).
#[tokio::test(crate = "crate::support::rt")]
async fn a_429_over_a_key_limit_names_the_key() {
    let cap = Capture::default();
    let _guard = cap.install();
    let file = std::env::temp_dir().join(format!("pdgate-it-429-{}.keys", std::process::id()));
    std::fs::write(&file, "team-429: sk-429-secret\n").unwrap();
    let hang = Faults {
        prefill_hang: true,
        ..Faults::default()
    };
    let env = Arc::new(
        start(
            vec![common::with_faults(EngineConfig::prefill(1), hang)],
            vec![EngineConfig::decode(1)],
            |c| {
                c.log.access = true;
                c.auth.api_keys_file = Some(file.clone());
                c.auth.per_key_max_in_flight = 1;
            },
        )
        .await,
    );
    env.wait_routable(1, 1).await;
    let keyed = |rid: &'static str| {
        let e = env.clone();
        async move {
            let h = [
                ("x-request-id", rid),
                ("content-type", "application/json"),
                ("x-api-key", "sk-429-secret"),
            ];
            let resp = e.send("POST", "/generate", &h, GEN.to_string()).await;
            let st = resp.status().as_u16();
            let _ = resp.into_body().collect().await;
            st
        }
    };
    // The key's one request hangs in the prefill...
    let held = tokio::spawn(keyed("k-held"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while env.cluster.prefills[0].stats().held_now < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the prefill never got the leg"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // ...so its next one is refused at once, under its key.
    assert_eq!(keyed("k-429").await, 429);
    let v = cap.line_for("k-429").await;
    assert_eq!(v["status"], 429, "{v}");
    assert_eq!(v["fail_reason"], "key_in_flight_limit", "{v}");
    assert_eq!(v["key_id"], "team-429", "{v}");
    let scrape = pdgate::telemetry::render(&());
    let want = format!(
        "pdgate_client_requests_total{{key=\"team-429\",outcome=\"{}\"}} 1\n",
        pdgate::error::FailReason::KeyInFlightLimit.as_str()
    );
    assert!(scrape.contains(&want), "{want} not in\n{scrape}");
    assert!(!scrape.contains("sk-429-secret"), "a key in the metrics");
    held.abort();
    let _ = std::fs::remove_file(&file);
}
