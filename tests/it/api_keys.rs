//! Client API keys on the front door (`pdgate::auth`) over real HTTP: the keys file's
//! lines, the 401 answered before any leg is sent, the per-key 429, the key id (never the
//! key) in logs, and a client's key never reaching an engine.

use std::path::PathBuf;
use std::time::Duration;

use http_body_util::BodyExt;
use pdgate::auth::{digest, hex, line_id};
use pdgate_sim::EngineConfig;
use serde_json::Value;

use crate::support::common::{fast_engine, sse_events, start, start_as_is, Captured, Env, GEN};

/// A keys file of its own for one test.
fn keys_file(test: &str, text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdgate-keys-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let f = dir.join("keys");
    std::fs::write(&f, text).expect("write");
    f
}

async fn post_with(
    env: &Env,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, http::HeaderMap, Vec<u8>) {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let resp = env.send("POST", path, &h, body.to_string()).await;
    let (parts, body) = resp.into_parts();
    let b = tokio::time::timeout(Duration::from_secs(30), body.collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    (parts.status.as_u16(), parts.headers, b.to_vec())
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":3}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_listed_keys_pass_and_a_refusal_sends_no_leg() {
    let hashed = hex(&digest(b"sk-hashed-2"));
    let file = keys_file(
        "lines",
        &format!(
            "# pdgate client keys\n\nsk-raw-1\nsha256:{hashed}   # hashed: the key is not in the file\nteam-a: sk-named-3\n"
        ),
    );
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| c.auth.api_keys_file = Some(file.clone()),
    )
    .await;
    env.wait_routable(1, 1).await;
    let hash_as_key = format!("Bearer sha256:{hashed}");
    let refused: Vec<Vec<(&str, &str)>> = vec![
        vec![],
        vec![("authorization", "Bearer nope")],
        vec![("authorization", "Basic c2stcmF3LTE=")],
        vec![("authorization", "Bearer ")],
        vec![("x-api-key", "sk-raw-1x")],
        vec![("authorization", "Bearer sk-named")],
        // The digest of a key is not the key.
        vec![("authorization", hash_as_key.as_str())],
        vec![("authorization", "Bearer team-a: sk-named-3")],
    ];
    for h in &refused {
        for (path, body) in [("/generate", GEN), ("/v1/chat/completions", CHAT)] {
            let (st, head, b) = post_with(&env, path, h, body).await;
            assert_eq!(st, 401, "{path} {h:?}: {}", String::from_utf8_lossy(&b));
            assert_eq!(head["www-authenticate"], "Bearer");
            let v: Value = serde_json::from_slice(&b).expect("JSON");
            assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
            assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
            assert!(v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
            assert!(
                !String::from_utf8_lossy(&b).contains("sk-"),
                "the key is not echoed: {v}"
            );
        }
    }
    let resp = env.send("GET", "/v1/models", &[], "").await;
    assert_eq!(resp.status(), 401);
    // Nothing reached an engine.
    let s = env.settled_stats().await;
    assert_eq!(s.requests_total, 0, "{s:?}");
    // Probes need no key.
    for path in ["/health", "/liveness", "/readiness"] {
        assert_eq!(env.send("GET", path, &[], "").await.status(), 200, "{path}");
    }
    let accepted: [&[(&str, &str)]; 4] = [
        &[("authorization", "Bearer sk-raw-1")],
        &[("x-api-key", "sk-hashed-2")],
        &[("authorization", "bearer sk-named-3")],
        &[("authorization", "Basic abc"), ("x-api-key", "sk-named-3")],
    ];
    for h in accepted {
        let (st, _, b) = post_with(&env, "/generate", h, GEN).await;
        assert_eq!(st, 200, "{h:?}: {}", String::from_utf8_lossy(&b));
    }
    let resp = env
        .send("GET", "/v1/models", &[("x-api-key", "sk-raw-1")], "")
        .await;
    assert_eq!(resp.status(), 200);
    let s = env.settled_stats().await;
    assert_eq!(s.requests_total, 8, "4 requests, 2 legs each: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_in_flight_limit_gets_429_and_others_do_not() {
    let file = keys_file(
        "limit",
        "team-a: sk-a\nteam-a: sk-a-rotated\nteam-b: sk-b\n",
    );
    // Tokens every 40 ms: a 50-token stream runs about two seconds.
    let slow = EngineConfig {
        itl: Duration::from_millis(40),
        ..fast_engine(EngineConfig::decode(1))
    };
    let env = start_as_is(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![slow],
        |c| {
            c.auth.api_keys_file = Some(file.clone());
            c.auth.per_key_max_in_flight = 1;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    let long = r#"{"text":"hello","stream":true,"sampling_params":{"max_new_tokens":50}}"#;
    let stream = env
        .send(
            "POST",
            "/generate",
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer sk-a"),
            ],
            long,
        )
        .await;
    assert_eq!(stream.status(), 200);
    let before = env.stats().requests_total;
    // Team A's second request (either of its keys): 429 at once, nothing sent.
    for key in ["sk-a", "sk-a-rotated"] {
        let (st, head, b) = post_with(&env, "/generate", &[("x-api-key", key)], GEN).await;
        assert_eq!(st, 429, "{key}: {}", String::from_utf8_lossy(&b));
        assert_eq!(head["retry-after"], "1");
        let v: Value = serde_json::from_slice(&b).expect("JSON");
        assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("team-a"),
            "{v}"
        );
    }
    assert_eq!(env.stats().requests_total, before, "a 429 sends no leg");
    // Team B is not limited by team A.
    let (st, _, b) = post_with(&env, "/generate", &[("x-api-key", "sk-b")], GEN).await;
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    // The stream ends; team A may send again.
    let all = tokio::time::timeout(Duration::from_secs(20), stream.into_body().collect())
        .await
        .expect("stream in time")
        .expect("stream")
        .to_bytes();
    assert!(sse_events(&all).1, "{}", String::from_utf8_lossy(&all));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        let (st, _, _) = post_with(&env, "/generate", &[("x-api-key", "sk-a")], GEN).await;
        if st == 200 {
            break;
        }
        assert_eq!(st, 429);
        assert!(
            tokio::time::Instant::now() < deadline,
            "team A's count never came back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every task (router, engines, client) logs into this test's subscriber, on whichever
/// thread it runs (`support::rt::set_default`).
#[tokio::test(crate = "crate::support::rt")]
async fn logs_carry_the_key_id_never_the_key() {
    let buf = Captured::default();
    let sink = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let _guard = crate::support::rt::set_default(subscriber);
    let file = keys_file("logs", "team-logs: sk-log-secret-1\nsk-log-secret-2\n");
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.auth.api_keys_file = Some(file.clone());
            c.auth.per_key_max_in_flight = 4;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    for h in [
        ("authorization", "Bearer sk-log-secret-1"),
        ("x-api-key", "sk-log-secret-2"),
        ("x-api-key", "sk-log-secret-3"),
    ] {
        let _ = post_with(&env, "/generate", &[h], GEN).await;
    }
    let text =
        String::from_utf8_lossy(&buf.0.lock().map(|v| v.clone()).unwrap_or_default()).to_string();
    assert!(text.contains("key_id=team-logs"), "{text}");
    // The unnamed key is known by its line, nothing derived from the key.
    let unnamed = line_id(2);
    let digest_prefix = hex(&digest(b"sk-log-secret-2")[..4]);
    assert!(
        !text.contains(&digest_prefix),
        "a digest prefix in the logs"
    );
    assert!(text.contains(&format!("key_id={unnamed}")), "{text}");
    assert!(text.contains("unknown client key"), "{text}");
    assert!(!text.contains("sk-log-secret"), "a key was logged:\n{text}");
    // Metrics carry the key id too, never the key.
    let scrape = pdgate::telemetry::render(&*env.router.pool);
    assert!(
        scrape.contains(r#"pdgate_client_requests_total{key="team-logs",outcome="ok"}"#),
        "{scrape}"
    );
    assert!(
        scrape.contains(&format!(
            r#"pdgate_client_requests_total{{key="{unnamed}",outcome="ok"}}"#
        )),
        "{scrape}"
    );
    assert!(!scrape.contains("sk-log-secret"), "a key in the metrics");
    assert!(
        !scrape.contains(&digest_prefix),
        "a digest prefix in the metrics"
    );
}

/// With client keys on, the client's `Authorization` is its pdgate key: engines get
/// `upstream.api_key` or nothing, whatever `upstream.forward_authorization` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_key_never_reaches_an_engine() {
    let file = keys_file("forward", "sk-client\n");
    // (keys on, forward_authorization, upstream.api_key, what the engines see)
    let table = [
        (true, true, None, None),
        (true, true, Some("engine-key"), Some("Bearer engine-key")),
        (true, false, None, None),
        // The control: without client keys the header is the engine's, and forwarded.
        (false, true, None, Some("Bearer sk-client")),
    ];
    for (keys, forward, upstream, want) in table {
        let env = start(
            vec![EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            |c| {
                if keys {
                    c.auth.api_keys_file = Some(file.clone());
                }
                c.upstream.forward_authorization = forward;
                c.upstream.api_key = upstream.map(str::to_string);
            },
        )
        .await;
        env.wait_routable(1, 1).await;
        let (st, _, b) = post_with(
            &env,
            "/generate",
            &[("authorization", "Bearer sk-client")],
            GEN,
        )
        .await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        for (side, e) in [
            ("prefill", &env.cluster.prefills[0]),
            ("decode", &env.cluster.decodes[0]),
        ] {
            let seen = e
                .last_generate_headers()
                .into_iter()
                .find(|(k, _)| k == "authorization")
                .map(|(_, v)| v);
            assert_eq!(
                seen.as_deref(),
                want,
                "{side} with keys={keys} forward={forward} upstream={upstream:?}"
            );
        }
    }
}

/// Polls (bounded: 10 s) until a request with `key` gets `want`.
async fn until_status(env: &Env, key: &str, want: u16) {
    let auth = format!("Bearer {key}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (st, _, _) = post_with(env, "/generate", &[("authorization", &auth)], GEN).await;
        if st == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{key}: still {st}, not {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn a_rotated_keys_file_takes_effect_without_a_signal() {
    let file = keys_file("rotate", "team-a: sk-old\n");
    let mut cfg_seen = None;
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.auth.api_keys_file = Some(file.clone());
            c.reload.secrets_watch_ms = 100;
            cfg_seen = Some(c.clone());
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    let cfg = cfg_seen.expect("config");
    // The config itself never changes; only the Secret's file does.
    let source: pdgate::reload::Source = Box::new(move || Ok(cfg.clone()));
    let watcher = pdgate::reload::run(&env.router, source, None, None);
    let rotate = async {
        until_status(&env, "sk-old", 200).await;
        // Rotated the way a Kubernetes Secret volume does it: a new file swapped in.
        let tmp = file.with_extension("new");
        std::fs::write(&tmp, "team-a: sk-new\n").expect("write");
        std::fs::rename(&tmp, &file).expect("swap");
        until_status(&env, "sk-new", 200).await;
        until_status(&env, "sk-old", 401).await;
    };
    tokio::select! {
        _ = watcher => panic!("the watch loop ended"),
        _ = rotate => {}
    }
}
