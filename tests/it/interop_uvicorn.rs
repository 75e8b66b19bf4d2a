//! Interop: the lean leg client (`pdgate::upstream`) against uvicorn, the HTTP server that
//! SGLang and vLLM engines run, with each of its HTTP/1.1 parsers (h11 and httptools).
//!
//! The engine is `tests/uvicorn_engine/app.py`: a Starlette app that answers `/generate`
//! and `/v1/chat/completions` as SGLang's `http_server.py` does (ORJSONResponse, SSE
//! StreamingResponse, error JSON, abort chunks), served with `timeout_keep_alive=5`, and that
//! records what it saw (the rid, client port and path of every request; streams cut by their
//! client). It runs from the venv at `target/sglang-venv`, where `.ci/run` installs
//! `tests/uvicorn_engine/requirements.txt`. Every engine listens on 127.0.0.1 (port 0), is a
//! child of its test and is killed when the test ends (and exits by itself after 120 s).
//!
//! What is asserted is what the engine saw and what the client got, never how long it took;
//! one test waits 5.5 s for uvicorn's keep-alive to expire, the others use a short idle
//! timeout in the leg settings instead. Without the venv or its packages the tests fail when
//! `CI` is set and are skipped (loudly) otherwise.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::interop::{cannot_run, drain, manifest, upstream, venv_python};
use http::{Method, StatusCode};
use http_body_util::BodyExt;
use pdgate::upstream::{parse_base_url, BaseUrl, HostConns, LegBody, LegRequest, Upstream};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const PARSERS: [&str; 2] = ["h11", "httptools"];
/// Bound on the app printing its READY line.
const READY_WAIT: Duration = Duration::from_secs(30);
/// Bound on each test's work (the keep-alive test has its own).
const TEST_WAIT: Duration = Duration::from_secs(60);
const CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// What the app's packages must provide.
const IMPORTS: &str = "import uvicorn, starlette, httptools, h11, orjson";

// ---------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------

/// The venv's python when it has the app's packages; else the test fails (these tests are
/// `#[ignore]`d, so they run only when asked for: `--include-ignored`, as `.ci/run` does).
fn python_or_skip(test: &str) -> Option<PathBuf> {
    let py = venv_python();
    let imports = py.is_file()
        && std::process::Command::new(&py)
            .args(["-c", IMPORTS])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    if imports {
        return Some(py);
    }
    let why = format!(
        "{} cannot `{IMPORTS}`; install them with `{} -m pip install -r \
         tests/uvicorn_engine/requirements.txt` (the venv itself comes from .ci/run)",
        py.display(),
        py.display()
    );
    cannot_run(test, &why)
}

/// One uvicorn engine (the app), child of this test, killed on drop.
struct Engine {
    parser: &'static str,
    base: BaseUrl,
    host: Arc<HostConns>,
    log: Arc<Mutex<String>>,
    _child: Child,
}

/// A request as the app saw it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
struct Seen {
    rid: String,
    port: u16,
    path: String,
}

impl Engine {
    async fn start(py: &PathBuf, parser: &'static str) -> Engine {
        let mut child = Command::new(py)
            .arg(manifest().join("tests/uvicorn_engine/app.py"))
            .args(["--port", "0", "--http", parser, "--max-seconds", "120"])
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", py.display()));
        let log = Arc::new(Mutex::new(String::new()));
        drain(child.stderr.take().unwrap(), log.clone());
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let port = tokio::time::timeout(READY_WAIT, async {
            while let Some(l) = lines.next_line().await.expect("read app stdout") {
                if let Some(p) = l.strip_prefix("READY ") {
                    return p.trim().parse::<u16>().ok();
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| panic!("{parser}: no READY line; stderr:\n{}", log.lock().unwrap()));
        let base = parse_base_url(&format!("http://127.0.0.1:{port}")).unwrap();
        let host = Arc::new(HostConns::new(&base));
        Engine {
            parser,
            base,
            host,
            log,
            _child: child,
        }
    }

    /// Every request the app read so far, in order.
    async fn seen(&self, up: &Upstream) -> Vec<Seen> {
        let (status, body) = up
            .get(&self.base, "/sim/requests", CALL_TIMEOUT)
            .await
            .expect("GET /sim/requests");
        assert_eq!(status, StatusCode::OK);
        serde_json::from_slice(&body).expect("requests JSON")
    }

    /// Whether the stream of `rid` was cut by its client (waits up to `secs` for it).
    async fn cancelled(&self, up: &Upstream, rid: &str, secs: f64) -> bool {
        let path = format!("/sim/wait_cancelled?rid={rid}&timeout={secs}");
        let (status, body) = up
            .get(&self.base, &path, CALL_TIMEOUT)
            .await
            .expect("GET /sim/wait_cancelled");
        assert_eq!(status, StatusCode::OK);
        let v: Value = serde_json::from_slice(&body).expect("JSON");
        v["cancelled"].as_bool().expect("cancelled flag")
    }

    /// Each of `rids` was read by the app exactly once, and nothing else was.
    async fn assert_each_seen_once(&self, up: &Upstream, rids: &[String]) -> Vec<Seen> {
        let seen = self.seen(up).await;
        let got: Vec<&str> = seen.iter().map(|s| s.rid.as_str()).collect();
        let want: Vec<&str> = rids.iter().map(String::as_str).collect();
        assert_eq!(got, want, "{}: requests the app read", self.parser);
        seen
    }
}

/// Runs `f` once per parser, each on a fresh engine, within `wait`.
async fn per_parser<F, Fut>(test: &str, wait: Duration, f: F)
where
    F: Fn(Engine, Upstream) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let Some(py) = python_or_skip(test) else {
        return;
    };
    for parser in PARSERS {
        let engine = Engine::start(&py, parser).await;
        let log = engine.log.clone();
        if tokio::time::timeout(wait, f(engine, upstream()))
            .await
            .is_err()
        {
            panic!(
                "{test} ({parser}) timed out; app stderr:\n{}",
                log.lock().unwrap()
            );
        }
    }
}

fn rid(tag: &str) -> String {
    format!("{tag}-{:016x}", rand::random::<u64>())
}

fn post(host: &HostConns, path: &str, body: &Value) -> LegRequest {
    LegRequest::post_json(host, path, serde_json::to_vec(body).unwrap(), b"")
}

/// Sends a leg and reads its whole answer: status, content type and body.
async fn whole(up: &Upstream, host: &Arc<HostConns>, req: &LegRequest) -> (u16, String, Vec<u8>) {
    let resp = up.send_leg(host, req).await.expect("leg");
    let status = resp.status().as_u16();
    let ctype = resp
        .headers()
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let body = resp.into_body().collect().await.expect("body").to_bytes();
    (status, ctype, body.to_vec())
}

/// The payloads of an SSE body's `data:` events, in order.
fn events(body: &[u8]) -> Vec<String> {
    let text = std::str::from_utf8(body).expect("utf-8 SSE");
    assert!(text.ends_with("\n\n"), "SSE ends with an event: {text:?}");
    text.split_terminator("\n\n")
        .map(|e| e.strip_prefix("data: ").expect("a data event").to_string())
        .collect()
}

/// The JSON events before `[DONE]` (which must end the stream).
fn json_events(body: &[u8]) -> Vec<Value> {
    let mut ev = events(body);
    assert_eq!(ev.pop().as_deref(), Some("[DONE]"));
    ev.iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

/// Token `i` of the app: one letter, `size` times.
fn token(i: usize, size: usize) -> String {
    let c = (b'a' + (i % 26) as u8) as char;
    c.to_string().repeat(size)
}

fn text(tokens: usize, size: usize) -> String {
    (0..tokens).map(|i| token(i, size)).collect()
}

fn sglang_error(code: u16, message: &str) -> Value {
    json!({"object": "error", "message": message, "type": "BadRequestError", "param": null, "code": code})
}

// ---------------------------------------------------------------------------------------
// Answers
// ---------------------------------------------------------------------------------------

/// Non-streamed and streamed answers of both routes, error JSON and abort chunks arrive as
/// SGLang writes them, all on one kept-alive connection.
#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn answers_arrive_as_sglang_writes_them() {
    per_parser(
        "answers_arrive_as_sglang_writes_them",
        TEST_WAIT,
        |e, up| async move {
            let h = &e.host;
            let p = e.parser;
            let mut rids = Vec::new();
            let mut next = |tag: &str| {
                rids.push(rid(tag));
                rids.last().unwrap().clone()
            };

            let r = next("gen");
            let body = json!({"rid": r, "sampling_params": {"max_new_tokens": 3}});
            let (status, ctype, b) = whole(&up, h, &post(h, "/generate", &body)).await;
            assert_eq!((status, ctype.as_str()), (200, "application/json"), "{p}");
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(v["text"], "abc", "{p}");
            assert_eq!(v["meta_info"]["id"], r.as_str(), "{p}");
            assert_eq!(v["meta_info"]["finish_reason"]["type"], "length", "{p}");

            let r = next("gen-stream");
            let body = json!({"rid": r, "stream": true, "sampling_params": {"max_new_tokens": 3}});
            let (status, ctype, b) = whole(&up, h, &post(h, "/generate", &body)).await;
            assert_eq!(status, 200, "{p}");
            assert!(ctype.starts_with("text/event-stream"), "{p}: {ctype}");
            let ev = json_events(&b);
            let texts: Vec<&str> = ev.iter().map(|v| v["text"].as_str().unwrap()).collect();
            assert_eq!(texts, ["a", "ab", "abc"], "{p}: cumulative chunks");
            assert_eq!(ev[2]["meta_info"]["finish_reason"]["type"], "length", "{p}");

            let r = next("chat");
            let body = json!({"rid": r, "messages": [{"role": "user", "content": "hi"}]});
            let (status, _, b) = whole(&up, h, &post(h, "/v1/chat/completions", &body)).await;
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(status, 200, "{p}");
            assert_eq!(v["choices"][0]["message"]["content"], "abcd", "{p}");

            let r = next("chat-stream");
            let body = json!({"rid": r, "stream": true, "max_tokens": 2});
            let (_, _, b) = whole(&up, h, &post(h, "/v1/chat/completions", &body)).await;
            let ev = json_events(&b);
            let deltas: Vec<&str> = ev
                .iter()
                .map(|v| v["choices"][0]["delta"]["content"].as_str().unwrap())
                .collect();
            assert_eq!(deltas, ["a", "b"], "{p}");

            let r = next("error");
            let body = json!({"rid": r, "sim": {"error": 400}});
            let (status, ctype, b) = whole(&up, h, &post(h, "/generate", &body)).await;
            assert_eq!((status, ctype.as_str()), (400, "application/json"), "{p}");
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(
                v,
                sglang_error(400, "rejected by the test (sim.error)"),
                "{p}"
            );

            let r = next("abort");
            let body = json!({"rid": r, "stream": true, "sim": {"abort_after": 2}});
            let (status, _, b) = whole(&up, h, &post(h, "/generate", &body)).await;
            assert_eq!(status, 200, "{p}: an abort in a stream comes after a 200");
            let ev = json_events(&b);
            assert_eq!(ev.len(), 3, "{p}: two tokens, then the abort");
            let finish = &ev[2]["meta_info"]["finish_reason"];
            assert_eq!(
                (finish["type"].as_str(), finish["status_code"].as_u64()),
                (Some("abort"), Some(500)),
                "{p}"
            );

            let r = next("abort-whole");
            let body = json!({"rid": r, "sim": {"abort_after": 1}});
            let (status, _, b) = whole(&up, h, &post(h, "/generate", &body)).await;
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!((status, v["code"].as_u64()), (500, Some(500)), "{p}");

            let r = next("abort-chat");
            let body = json!({"rid": r, "stream": true, "sim": {"abort_after": 1}});
            let (_, _, b) = whole(&up, h, &post(h, "/v1/chat/completions", &body)).await;
            let ev = json_events(&b);
            assert_eq!(ev.len(), 2, "{p}: a token, then the error chunk");
            assert_eq!(ev[1]["error"]["code"], 500, "{p}");

            let (status, _) = up.get(&e.base, "/health", CALL_TIMEOUT).await.unwrap();
            assert_eq!(status, StatusCode::OK, "{p}");

            let seen = e.assert_each_seen_once(&up, &rids).await;
            let ports: BTreeSet<u16> = seen.iter().map(|s| s.port).collect();
            assert_eq!(
                ports.len(),
                1,
                "{p}: one kept-alive connection for all: {seen:?}"
            );
            assert_eq!(e.host.idle_count(), 1, "{p}");
        },
    )
    .await;
}

/// `POST /abort_request` ends a running stream with SGLang's abort chunk and `[DONE]`.
#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn abort_request_ends_a_running_stream() {
    per_parser("abort_request_ends_a_running_stream", TEST_WAIT, |e, up| async move {
        let r = rid("abort-req");
        let body = json!({"rid": r, "stream": true, "sampling_params": {"max_new_tokens": 100_000}, "sim": {"delay_ms": 5}});
        let resp = up.send_leg(&e.host, &post(&e.host, "/generate", &body)).await.unwrap();
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(first.starts_with(b"data: {"), "{}", e.parser);
        let abort = serde_json::to_vec(&json!({"rid": r, "abort_all": false})).unwrap();
        let uri = e.base.uri("/abort_request").unwrap();
        let (status, _) = up.call(Method::POST, uri, Some(abort.into()), CALL_TIMEOUT).await.unwrap();
        assert_eq!(status, StatusCode::OK);
        let rest = body.collect().await.unwrap().to_bytes();
        let all = [&first[..], &rest[..]].concat();
        let ev = json_events(&all);
        let last = ev.last().unwrap();
        assert_eq!(last["meta_info"]["finish_reason"]["type"], "abort", "{}", e.parser);
        assert!(ev.len() < 100_000, "{}: the stream was cut", e.parser);
        e.assert_each_seen_once(&up, &[r]).await;
    })
    .await;
}

/// Answers larger than the leg's read buffer (4 KiB): a 1 MiB non-streamed answer, a
/// stream of 5000 events, and a stream whose cumulative events grow to 12.8 KiB each; each
/// leaves its connection reusable. (The legs go back to back and are checked afterwards:
/// checking them in between can take long enough in a loaded debug build for the idle
/// connection to age out.)
#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn answers_larger_than_the_read_buffer_arrive_whole() {
    per_parser("answers_larger_than_the_read_buffer_arrive_whole", TEST_WAIT, |e, up| async move {
        let (h, p) = (&e.host, e.parser);
        let rids = [rid("mib"), rid("long"), rid("wide")];
        let bodies = [
            json!({"rid": rids[0], "sampling_params": {"max_new_tokens": 1024}, "sim": {"token_bytes": 1024}}),
            json!({"rid": rids[1], "stream": true, "sampling_params": {"max_new_tokens": 5000}, "sim": {"incremental": true}}),
            json!({"rid": rids[2], "stream": true, "sampling_params": {"max_new_tokens": 200}, "sim": {"token_bytes": 64}}),
        ];
        let mut answers = Vec::new();
        for body in &bodies {
            answers.push(whole(&up, h, &post(h, "/generate", body)).await);
        }
        assert!(answers.iter().all(|a| a.0 == 200), "{p}");

        let v: Value = serde_json::from_slice(&answers[0].2).unwrap();
        let t = v["text"].as_str().unwrap();
        assert_eq!(t.len(), 1 << 20, "{p}");
        assert!(t == text(1024, 1024), "{p}: the 1 MiB text differs");

        let ev = json_events(&answers[1].2);
        assert_eq!(ev.len(), 5000, "{p}");
        let joined: String = ev.iter().map(|v| v["text"].as_str().unwrap()).collect();
        assert!(joined == text(5000, 1), "{p}: the long stream's text differs");

        let ev = json_events(&answers[2].2);
        assert_eq!(ev.len(), 200, "{p}");
        for (k, v) in ev.iter().enumerate() {
            assert!(v["text"].as_str().unwrap() == text(k + 1, 64), "{p}: event {k}");
        }
        let seen = e.assert_each_seen_once(&up, &rids).await;
        assert!(seen.iter().all(|s| s.port == seen[0].port), "{p}: one connection: {seen:?}");
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Early errors
// ---------------------------------------------------------------------------------------

/// An engine that rejects a request before reading its (32 MiB) body gets its answer
/// reported, whether uvicorn then closes with the body unread or reads it away and keeps
/// the connection; an error after reading the body keeps the connection.
#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn early_errors_are_answered() {
    per_parser("early_errors_are_answered", TEST_WAIT, |e, up| async move {
        let (h, p) = (&e.host, e.parser);
        let big = {
            let mut b = br#"{"pad":""#.to_vec();
            b.resize(32 << 20, b' ');
            b.extend_from_slice(br#""}"#);
            b
        };
        let early = sglang_error(413, "rejected before reading the body");
        for (close, status) in [(true, 413u16), (false, 400)] {
            let mut fwd = format!("x-sim-early-status: {status}\r\n");
            if close {
                fwd.push_str("x-sim-early-close: 1\r\n");
            }
            let req = LegRequest::post_json(h, "/generate", big.clone(), fwd.as_bytes());
            let (got, _, b) = whole(&up, h, &req).await;
            let v: Value = serde_json::from_slice(&b).unwrap();
            assert_eq!(got, status, "{p} close={close}");
            assert_eq!(v["message"], early["message"], "{p} close={close}");
            assert_eq!(v["code"], status, "{p} close={close}");
            assert_eq!(
                h.idle_count(),
                usize::from(!close),
                "{p} close={close}: pooled"
            );
        }
        // The connection uvicorn kept serves the next legs; a 400 after the body keeps it.
        let rids = vec![rid("after-early"), rid("late-error"), rid("after-error")];
        let (status, _, _) = whole(&up, h, &post(h, "/generate", &json!({"rid": rids[0]}))).await;
        assert_eq!(status, 200, "{p}");
        let body = json!({"rid": rids[1], "sim": {"error": 400}});
        assert_eq!(
            whole(&up, h, &post(h, "/generate", &body)).await.0,
            400,
            "{p}"
        );
        let (status, _, _) = whole(&up, h, &post(h, "/generate", &json!({"rid": rids[2]}))).await;
        assert_eq!(status, 200, "{p}");
        let seen = e.assert_each_seen_once(&up, &rids).await;
        assert!(seen.iter().all(|s| s.port == seen[0].port), "{p}: {seen:?}");
    })
    .await;
}

// ---------------------------------------------------------------------------------------
// Connections
// ---------------------------------------------------------------------------------------

/// Sequential legs within the keep-alive share one connection; a leg after pdgate's idle
/// timeout (300 ms here) goes on a new one; each request reaches the engine once.
#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn connections_are_reused_only_within_the_idle_timeout() {
    per_parser(
        "connections_are_reused_only_within_the_idle_timeout",
        TEST_WAIT,
        |e, up| async move {
            let mut legs = up.legs;
            legs.idle_timeout = Duration::from_millis(300);
            let up = up.with_leg_settings(legs);
            let (h, p) = (&e.host, e.parser);
            let rids: Vec<String> = (0..6).map(|k| rid(&format!("seq{k}"))).collect();
            for (k, r) in rids[..5].iter().enumerate() {
                let body = json!({"rid": r, "stream": k % 2 == 1});
                assert_eq!(
                    whole(&up, h, &post(h, "/generate", &body)).await.0,
                    200,
                    "{p}"
                );
            }
            assert_eq!(h.idle_count(), 1, "{p}");
            // Time passing is what is tested here: the pooled connection ages out.
            tokio::time::sleep(Duration::from_millis(400)).await;
            let body = json!({"rid": rids[5]});
            assert_eq!(
                whole(&up, h, &post(h, "/generate", &body)).await.0,
                200,
                "{p}"
            );
            let seen = e.assert_each_seen_once(&up, &rids).await;
            let ports: Vec<u16> = seen.iter().map(|s| s.port).collect();
            assert!(ports[..5].iter().all(|&x| x == ports[0]), "{p}: {ports:?}");
            assert_ne!(ports[5], ports[0], "{p}: the aged connection was reused");
        },
    )
    .await;
}

/// uvicorn closes a connection idle for 5 s (`timeout_keep_alive=5`). After 5.5 s idle, the
/// next leg neither uses that connection nor reaches the engine twice: with the default
/// idle timeout (4 s) the connection was dropped by age; with the 90 s pdgate used to keep
/// them, it is found closed before the write. Both parsers and both settings wait together.
#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn a_connection_uvicorn_closed_is_not_used() {
    let Some(py) = python_or_skip("a_connection_uvicorn_closed_is_not_used") else {
        return;
    };
    let up = upstream();
    let mut old = up.legs;
    old.idle_timeout = Duration::from_secs(90);
    let settings = [up.clone(), up.with_leg_settings(old)];
    let engines = [
        Engine::start(&py, "h11").await,
        Engine::start(&py, "httptools").await,
    ];
    let run = |e: &Engine, up: Upstream, k: usize| {
        let e_host = Arc::new(HostConns::new(&e.base));
        let rids = [rid(&format!("before{k}")), rid(&format!("after{k}"))];
        async move {
            let first = post(&e_host, "/generate", &json!({"rid": rids[0]}));
            assert_eq!(whole(&up, &e_host, &first).await.0, 200);
            assert_eq!(e_host.idle_count(), 1);
            // Waiting out uvicorn's keep-alive is the point of this test.
            tokio::time::sleep(Duration::from_millis(5500)).await;
            let second = post(&e_host, "/generate", &json!({"rid": rids[1]}));
            let r = up.send_leg(&e_host, &second).await;
            let resp = r.unwrap_or_else(|err| panic!("settings {k}: {err}"));
            assert_eq!(resp.status(), 200);
            assert_eq!(
                resp.into_body().collect().await.unwrap().to_bytes()[..1],
                *b"{"
            );
            rids
        }
    };
    let work = async {
        let mut jobs = Vec::new();
        for e in &engines {
            for (k, up) in settings.iter().enumerate() {
                jobs.push(run(e, up.clone(), k));
            }
        }
        futures_util::future::join_all(jobs).await
    };
    let all = tokio::time::timeout(TEST_WAIT, work)
        .await
        .expect("bounded");
    for (i, e) in engines.iter().enumerate() {
        let mut seen = e.seen(&up).await;
        seen.sort_by(|a, b| a.rid.cmp(&b.rid));
        let mut want: Vec<String> = all[2 * i..2 * i + 2].concat();
        want.sort();
        let got: Vec<&str> = seen.iter().map(|s| s.rid.as_str()).collect();
        assert_eq!(got, want, "{}: each request read once", e.parser);
        for pair in all[2 * i..2 * i + 2].iter() {
            let port = |r: &String| seen.iter().find(|s| &s.rid == r).unwrap().port;
            assert_ne!(
                port(&pair[0]),
                port(&pair[1]),
                "{}: a new connection",
                e.parser
            );
        }
    }
}

/// A client that goes away mid-stream (the leg's body dropped) closes the connection, and
/// uvicorn reports the disconnect to the app, which stops the stream; a stream read to its
/// end is not reported as cut.
#[tokio::test(crate = "crate::support::rt")]
#[ignore = "needs the SGLang venv (target/sglang-venv); .ci/run builds it and runs these with --include-ignored"]
async fn a_client_gone_mid_stream_cancels_it() {
    per_parser("a_client_gone_mid_stream_cancels_it", TEST_WAIT, |e, up| async move {
        let (h, p) = (&e.host, e.parser);
        let done = rid("done");
        let body = json!({"rid": done, "stream": true});
        assert_eq!(whole(&up, h, &post(h, "/generate", &body)).await.0, 200, "{p}");
        let cut = rid("cut");
        let body = json!({"rid": cut, "stream": true, "sampling_params": {"max_new_tokens": 100_000}, "sim": {"delay_ms": 10}});
        let resp = up.send_leg(h, &post(h, "/generate", &body)).await.unwrap();
        let mut b: LegBody = resp.into_body();
        let first = b.frame().await.unwrap().unwrap().into_data().unwrap();
        assert!(first.starts_with(b"data: {"), "{p}");
        drop(b);
        assert_eq!(h.idle_count(), 0, "{p}: the cut connection is not pooled");
        assert!(e.cancelled(&up, &cut, 10.0).await, "{p}: the app saw no disconnect");
        assert!(!e.cancelled(&up, &done, 0.2).await, "{p}: a whole stream is not cut");
        e.assert_each_seen_once(&up, &[done, cut]).await;
    })
    .await;
}
