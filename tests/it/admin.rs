//! The admin listener over real HTTP (`pdgate::admin`): the token on every route but
//! `/metrics`, the error shapes, adding a worker that becomes routable only once checked,
//! drain / undrain / delete with a stream in flight, SGLang router's calls, the redacted
//! config, and the refusal to expose an admin listener without a token.

use std::sync::atomic::Ordering;
use std::time::Duration;

use pdgate::pool::{PodRef, WorkerSource};
use pdgate::router::{AdminListener, StartError};
use pdgate::types::Role;
use pdgate_sim::EngineConfig;
use serde_json::Value;

use crate::support::common::{
    self, fast_config, fast_engine, gen_body, start_with_admin, Env, GEN,
};

const TOKEN: &str = "adm1n-t0ken";

fn json(b: &[u8]) -> Value {
    serde_json::from_slice(b)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(b)))
}

async fn env_with_token() -> Env {
    start_with_admin(
        vec![fast_engine(EngineConfig::prefill(2))],
        vec![fast_engine(EngineConfig::decode(1))],
        |c| c.admin.api_key = Some(TOKEN.to_string()),
    )
    .await
}

/// Waits (bounded: 10 s) until `GET /workers/{id}` satisfies `f`; returns that view.
async fn wait_worker(env: &Env, id: &str, what: &str, f: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (st, _, b) = env
            .admin("GET", &format!("/workers/{id}"), Some(TOKEN), "")
            .await;
        let v = if st == 200 { json(&b) } else { Value::Null };
        if f(&v) {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id}: timed out waiting for {what}; last {st}: {v}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_route_needs_the_token_but_metrics_and_errors_have_one_shape() {
    let env = env_with_token().await;
    env.wait_routable(2, 1).await;
    let decode_url = env.cluster.decodes[0].url();
    let dup = format!(r#"{{"role":"decode","url":"{decode_url}"}}"#);
    // (method, path, body, status with the token, error type when it fails)
    let table: Vec<(&str, String, String, u16, Option<&str>)> = vec![
        ("GET", "/workers".into(), "".into(), 200, None),
        ("GET", "/workers/prefill-0".into(), "".into(), 200, None),
        (
            "GET",
            "/workers/prefill-9".into(),
            "".into(),
            404,
            Some("not_found"),
        ),
        (
            "GET",
            "/workers/p0".into(),
            "".into(),
            404,
            Some("not_found"),
        ),
        (
            "POST",
            "/workers/decode-0/drain".into(),
            "".into(),
            200,
            None,
        ),
        (
            "POST",
            "/workers/decode-0/undrain".into(),
            "".into(),
            200,
            None,
        ),
        (
            "DELETE",
            "/workers/decode-7".into(),
            "".into(),
            404,
            Some("not_found"),
        ),
        ("GET", "/config".into(), "".into(), 200, None),
        ("GET", "/list_workers".into(), "".into(), 200, None),
        ("GET", "/nowhere".into(), "".into(), 404, Some("not_found")),
        (
            "POST",
            "/config".into(),
            "".into(),
            405,
            Some("method_not_allowed"),
        ),
        (
            "GET",
            "/add_worker".into(),
            "".into(),
            405,
            Some("method_not_allowed"),
        ),
        (
            "POST",
            "/add_worker".into(),
            "".into(),
            400,
            Some("invalid_request"),
        ),
        (
            "POST",
            format!("/add_worker?url={decode_url}&worker_type=encode"),
            "".into(),
            400,
            Some("invalid_request"),
        ),
        (
            "POST",
            "/remove_worker?url=http://127.0.0.1:1".into(),
            "".into(),
            404,
            Some("not_found"),
        ),
        (
            "POST",
            "/workers".into(),
            "{".into(),
            400,
            Some("invalid_request"),
        ),
        (
            "POST",
            "/workers".into(),
            r#"{"role":"encode","url":"http://127.0.0.1:1"}"#.into(),
            400,
            Some("invalid_request"),
        ),
        (
            "POST",
            "/workers".into(),
            r#"{"role":"decode","url":"http://127.0.0.1:1","priority":1}"#.into(),
            400,
            Some("invalid_request"),
        ),
        (
            "POST",
            "/workers".into(),
            r#"{"role":"decode","url":"http://127.0.0.1:1","bootstrap_port":9}"#.into(),
            400,
            Some("invalid_request"),
        ),
        ("POST", "/workers".into(), dup, 409, Some("conflict")),
    ];
    for (method, path, body, want, err) in &table {
        for bad in [None, Some("wrong"), Some("adm1n-t0ke")] {
            let (st, h, b) = env.admin(method, path, bad, body).await;
            assert_eq!(st, 401, "{method} {path} with {bad:?}");
            assert_eq!(h["www-authenticate"], "Bearer", "{method} {path}");
            let v = json(&b);
            assert_eq!(v["error"]["type"], "unauthorized", "{v}");
            assert_eq!(v["error"]["code"], 401, "{v}");
        }
        let (st, h, b) = env.admin(method, path, Some(TOKEN), body).await;
        assert_eq!(
            st.as_u16(),
            *want,
            "{method} {path}: {}",
            String::from_utf8_lossy(&b)
        );
        if let Some(kind) = err {
            let v = json(&b);
            assert_eq!(v["error"]["type"], *kind, "{method} {path}: {v}");
            assert_eq!(v["error"]["code"], *want, "{v}");
            assert!(v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()));
            if *want == 405 {
                assert!(h.contains_key("allow"), "{method} {path}");
            }
        }
    }
    // The duplicate names the worker that has the URL.
    let (_, _, b) = env
        .admin(
            "POST",
            "/workers",
            Some(TOKEN),
            &format!(r#"{{"role":"decode","url":"{decode_url}"}}"#),
        )
        .await;
    assert!(json(&b)["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("decode-0"));
    // Prometheus scrapes without a token.
    let (st, h, b) = env.admin("GET", "/metrics", None, "").await;
    assert_eq!(st, 200);
    assert!(h["content-type"]
        .to_str()
        .unwrap_or("")
        .starts_with("text/plain"));
    assert!(
        String::from_utf8_lossy(&b).contains("pdgate_"),
        "metrics text"
    );
    // ... and not from the front door, by default.
    let resp = env.send("GET", "/metrics", &[], "").await;
    assert_eq!(resp.status(), 404);
    // A kubelet's liveness probe holds no token either; nothing else is open.
    let (st, _, b) = env.admin("GET", "/liveness", None, "").await;
    assert_eq!(st, 200);
    assert_eq!(json(&b)["status"], "ok");
    let (st, _, _) = env.admin("GET", "/readiness", None, "").await;
    assert_eq!(st, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_show_source_health_breaker_ranks_and_in_flight() {
    let env = env_with_token().await;
    env.wait_routable(2, 1).await;
    let (st, _, b) = env.admin("GET", "/workers", Some(TOKEN), "").await;
    assert_eq!(st, 200);
    let v = json(&b);
    assert_eq!(v["total"], 2);
    assert_eq!(v["stats"]["routable_prefill_ranks"], 2);
    let p = &v["workers"][0];
    assert_eq!(p["id"], "prefill-0");
    assert_eq!(p["role"], "prefill");
    assert_eq!(p["url"], env.cluster.prefills[0].url());
    assert_eq!(p["source"]["kind"], "static");
    assert_eq!(p["healthy"], true);
    assert_eq!(p["health_checked"], true);
    assert_eq!(p["routable"], true);
    assert_eq!(p["draining"], false);
    assert_eq!(p["breaker"], "closed");
    assert_eq!(p["dp_size"], 2);
    assert_eq!(p["in_flight"], 0);
    assert_eq!(p["ranks"].as_array().map(Vec::len), Some(2));
    for r in p["ranks"].as_array().into_iter().flatten() {
        assert_eq!(r["bootstrap"], "ready", "{r}");
        assert_eq!(r["routable"], true, "{r}");
    }
    assert!(p["bootstrap"]["port"].as_u64().is_some(), "{p}");
    assert!(p["server_info"]["dp_size"].as_u64().is_some(), "{p}");
    let d = &v["workers"][1];
    assert_eq!(d["id"], "decode-0");
    assert!(
        d["ranks"][0].get("bootstrap").is_none(),
        "decode ranks have no bootstrap: {d}"
    );

    // A discovered worker shows its pod, may be drained, and is not the admin API's to
    // remove.
    let pod = WorkerSource::Discovered(PodRef {
        namespace: "llm".into(),
        name: "decode-abc".into(),
        uid: "uid-1".into(),
    });
    let url = pdgate::url::parse_base_url("http://127.0.0.1:9").expect("url");
    let id = env
        .router
        .fleet
        .add(pdgate::fleet::WorkerSpec {
            role: Role::Decode,
            url,
            bootstrap_port: None,
            bootstrap_host: None,
            source: pod,
            model: None,
        })
        .expect("added");
    let r = format!("decode-{}", id.0);
    let (_, _, b) = env
        .admin("GET", &format!("/workers/{r}"), Some(TOKEN), "")
        .await;
    let w = json(&b);
    assert_eq!(w["source"]["kind"], "discovered");
    assert_eq!(w["source"]["pod"], "decode-abc");
    assert_eq!(w["source"]["namespace"], "llm");
    assert_eq!(w["source"]["uid"], "uid-1");
    for (method, path) in [
        ("DELETE", format!("/workers/{r}")),
        (
            "POST",
            "/remove_worker?url=http%3A%2F%2F127.0.0.1%3A9".to_string(),
        ),
    ] {
        let (st, _, b) = env.admin(method, &path, Some(TOKEN), "").await;
        assert_eq!(st, 409, "{method} {path}");
        assert!(json(&b)["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("discovery"));
    }
    let (st, _, b) = env
        .admin("POST", &format!("/workers/{r}/drain"), Some(TOKEN), "")
        .await;
    assert_eq!(st, 200);
    assert_eq!(json(&b)["draining"], true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_worker_takes_traffic_only_once_checked() {
    let env = env_with_token().await;
    env.wait_routable(2, 1).await;
    // An engine that answers /health but has no /server_info: added, never routable.
    let (blind, checks) = crate::fleet::health_only_engine().await;
    let (st, h, b) = env
        .admin(
            "POST",
            "/workers",
            Some(TOKEN),
            &format!(r#"{{"role":"decode","url":"{blind}"}}"#),
        )
        .await;
    assert_eq!(st, 201, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    let blind_id = v["id"].as_str().unwrap_or("").to_string();
    assert_eq!(h["location"], format!("/workers/{blind_id}").as_str());
    assert_eq!(v["source"]["kind"], "admin");
    assert_eq!(v["routable"], false);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while checks.load(Ordering::SeqCst) < 5 {
        assert!(tokio::time::Instant::now() < deadline, "no health checks");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, _, b) = env
        .admin("GET", &format!("/workers/{blind_id}"), Some(TOKEN), "")
        .await;
    assert_eq!(
        json(&b)["routable"],
        false,
        "health alone does not admit it"
    );

    // A real engine (SGLang's field names): routable once its checks passed, then serves.
    let extra = pdgate_sim::spawn(fast_engine(EngineConfig::decode(1)))
        .await
        .expect("engine");
    let (st, _, b) = env
        .admin(
            "POST",
            "/workers",
            Some(TOKEN),
            &format!(r#"{{"worker_type":"decode","url":"{}"}}"#, extra.url()),
        )
        .await;
    assert_eq!(st, 201, "{}", String::from_utf8_lossy(&b));
    let id = json(&b)["id"].as_str().unwrap_or("").to_string();
    let v = wait_worker(&env, &id, "routable", |v| v["routable"] == true).await;
    assert_eq!(v["healthy"], true);
    assert_eq!(v["health_checked"], true);
    for _ in 0..10 {
        let (st, _, b) = env.post("/generate", GEN).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    assert!(extra.stats().requests_total > 0, "the added decode serves");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_router_calls_keep_working() {
    let env = start_with_admin(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |_| {},
    )
    .await;
    env.wait_routable(1, 1).await;
    // Loopback without a token: open.
    let extra = pdgate_sim::spawn(fast_engine(EngineConfig::prefill(1)))
        .await
        .expect("engine");
    let port = extra.bootstrap_port().expect("bootstrap port");
    let url = extra.url();
    let (st, h, b) = env
        .admin(
            "POST",
            &format!("/add_worker?url={url}&worker_type=prefill&bootstrap_port={port}"),
            None,
            "",
        )
        .await;
    let text = String::from_utf8_lossy(&b).to_string();
    assert_eq!(st, 200, "{text}");
    assert!(h["content-type"]
        .to_str()
        .unwrap_or("")
        .starts_with("text/plain"));
    assert!(
        text.starts_with("Successfully added prefill worker"),
        "{text}"
    );
    assert!(text.contains("prefill-1"), "{text}");
    env.wait_routable(2, 1).await;
    let (st, _, b) = env.admin("GET", "/list_workers", None, "").await;
    assert_eq!(st, 200);
    let v = json(&b);
    assert_eq!(v["urls"].as_array().map(Vec::len), Some(3), "{v}");
    assert!(v["urls"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|u| u == url.as_str()));
    assert!(v["prefill"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|u| u == url.as_str()));
    // Again: 409, naming it.
    let (st, _, b) = env
        .admin(
            "POST",
            &format!("/add_worker?url={url}&worker_type=prefill"),
            None,
            "",
        )
        .await;
    assert_eq!(st, 409);
    assert!(json(&b)["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("prefill-1"));
    // Removed (drained first: nothing in flight, so at once).
    let (st, _, b) = env
        .admin("POST", &format!("/remove_worker?url={url}"), None, "")
        .await;
    let text = String::from_utf8_lossy(&b).to_string();
    assert_eq!(st, 200, "{text}");
    assert!(text.starts_with("Successfully removed worker"), "{text}");
    wait_worker(&env, "prefill-1", "gone", |v| v.is_null()).await;
    let (_, _, b) = env.admin("GET", "/list_workers", None, "").await;
    assert_eq!(json(&b)["urls"].as_array().map(Vec::len), Some(2));
    let (st, _, _) = env
        .admin("POST", &format!("/remove_worker?url={url}"), None, "")
        .await;
    assert_eq!(st, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_undrain_and_delete_let_a_stream_in_flight_finish() {
    // Tokens every 40 ms: a 50-token stream runs about two seconds.
    let slow = || EngineConfig {
        itl: Duration::from_millis(40),
        ..fast_engine(EngineConfig::decode(1))
    };
    let env = common::start_with_admin(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![slow(), slow()],
        |c| c.admin.api_key = Some(TOKEN.to_string()),
    )
    .await;
    env.wait_routable(1, 2).await;
    let long = r#"{"text":"hello","stream":true,"sampling_params":{"max_new_tokens":50}}"#;
    let stream = env.post_streaming("/generate", long).await;
    assert_eq!(stream.status(), 200);
    let busy = env.busy_decode();
    let (busy_id, other_id) = (format!("decode-{busy}"), format!("decode-{}", 1 - busy));
    let v = wait_worker(&env, &busy_id, "its stream counted", |v| {
        v["in_flight"] == 1
    })
    .await;
    assert_eq!(v["ranks"][0]["in_flight"], 1);

    // Drain the idle one: out of rotation at once, so nothing is routable for decode.
    let (st, _, b) = env
        .admin(
            "POST",
            &format!("/workers/{other_id}/drain"),
            Some(TOKEN),
            "",
        )
        .await;
    assert_eq!(st, 200);
    let v = json(&b);
    assert_eq!(
        (v["draining"].clone(), v["routable"].clone()),
        (Value::Bool(true), Value::Bool(false))
    );
    // Delete the busy one, waiting for its stream.
    let deleting = {
        let base = env.router.admin_url().expect("admin");
        let client = common::client();
        let path = format!("{base}/workers/{busy_id}?wait=true");
        tokio::spawn(async move {
            let req = http::Request::builder()
                .method("DELETE")
                .uri(path)
                .header("authorization", format!("Bearer {TOKEN}"))
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .expect("request");
            let resp = client.request(req).await.expect("answer");
            let status = resp.status();
            let body = http_body_util::BodyExt::collect(resp.into_body())
                .await
                .expect("body")
                .to_bytes();
            (status, body)
        })
    };
    wait_worker(&env, &busy_id, "draining", |v| v["draining"] == true).await;
    // Both decodes out: a new request finds no decode.
    let (st, _, b) = env.post("/generate", GEN).await;
    assert_eq!(st, 503, "{}", String::from_utf8_lossy(&b));
    // Undrain the other: it serves again.
    let (st, _, b) = env
        .admin(
            "POST",
            &format!("/workers/{other_id}/undrain"),
            Some(TOKEN),
            "",
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(json(&b)["routable"], true);
    let before = env.cluster.decodes[busy].stats().requests_total;
    for _ in 0..4 {
        let (st, _, b) = env.post("/generate", gen_body(false)).await;
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    }
    assert_eq!(
        env.cluster.decodes[busy].stats().requests_total,
        before,
        "the deleted one takes nothing"
    );
    assert!(!deleting.is_finished(), "the DELETE waits for the stream");

    // The stream runs to its end, untouched; then the DELETE answers.
    common::finish_clean(stream).await;
    let (st, b) = tokio::time::timeout(Duration::from_secs(10), deleting)
        .await
        .expect("DELETE in time")
        .expect("task");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v = json(&b);
    assert_eq!(v["outcome"], "drained", "{v}");
    let (st, _, _) = env
        .admin("GET", &format!("/workers/{busy_id}"), Some(TOKEN), "")
        .await;
    assert_eq!(st, 404);
    // Without ?wait: 202 at once.
    let (st, _, b) = env
        .admin("DELETE", &format!("/workers/{other_id}"), Some(TOKEN), "")
        .await;
    assert_eq!(st, 202);
    assert_eq!(json(&b)["state"], "removing");
    wait_worker(&env, &other_id, "gone", |v| v.is_null()).await;
}

#[tokio::test(crate = "crate::support::rt")]
async fn config_is_the_effective_one_with_secrets_redacted() {
    let env = start_with_admin(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |c| {
            c.admin.api_key = Some(TOKEN.to_string());
            c.upstream.api_key = Some("engine-s3cret".to_string());
            c.retry.max_retries = 7;
        },
    )
    .await;
    let (st, _, b) = env.admin("GET", "/config", Some(TOKEN), "").await;
    assert_eq!(st, 200);
    let text = String::from_utf8_lossy(&b).to_string();
    assert!(
        !text.contains("engine-s3cret") && !text.contains(TOKEN),
        "{text}"
    );
    let v = json(&b);
    assert_eq!(v["admin"]["api_key"], "<redacted>");
    assert_eq!(v["upstream"]["api_key"], "<redacted>");
    assert_eq!(v["retry"]["max_retries"], 7);
    assert_eq!(v["decode"][0]["url"], env.cluster.decodes[0].url());
}

#[tokio::test(crate = "crate::support::rt")]
async fn an_exposed_admin_listener_needs_a_token() {
    let front = || async {
        tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind")
    };
    // Refused before anything is bound, naming the keys to set.
    if std::env::var(pdgate::admin::token::TOKEN_ENV).is_err() {
        let mut cfg = fast_config();
        cfg.admin.host = "0.0.0.0".parse().expect("ip");
        cfg.admin.port = 0;
        let r = pdgate::router::start_with(
            cfg,
            Some(front().await),
            AdminListener::FromConfig,
            pdgate::dispatch::RngSource::Os,
        )
        .await;
        let Err(StartError::Admin(msg)) = r else {
            panic!("an exposed admin listener without a token started");
        };
        for key in [
            "admin.api_key",
            "admin.api_key_file",
            "PDGATE_ADMIN_API_KEY",
            "--admin-host",
        ] {
            assert!(msg.contains(key), "{msg}");
        }
    }
    // Disabled: no admin listener at all, wherever it would have been.
    let mut cfg = fast_config();
    cfg.admin.host = "0.0.0.0".parse().expect("ip");
    cfg.admin.enabled = false;
    let router = pdgate::router::start_with(
        cfg,
        Some(front().await),
        AdminListener::FromConfig,
        pdgate::dispatch::RngSource::Os,
    )
    .await
    .expect("router");
    assert!(router.admin.is_none());
    // A token file that cannot be read is refused too.
    let mut cfg = fast_config();
    cfg.admin.api_key_file = Some("/nonexistent/pdgate-admin-token".into());
    let admin = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let r = pdgate::router::start_with(
        cfg,
        Some(front().await),
        AdminListener::Bound(admin),
        pdgate::dispatch::RngSource::Os,
    )
    .await;
    assert!(matches!(r, Err(StartError::Admin(m)) if m.contains("admin.api_key_file")));
}

/// Sends one raw HTTP/1.1 request (exactly these header lines) and returns the status.
async fn raw_status(addr: std::net::SocketAddr, head: &str, body: &str) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{head}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("answer in time")
        .expect("read");
    let text = String::from_utf8_lossy(&out);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_reach_the_admin_api() {
    // No token (loopback): the case a web page on the operator's machine would exploit.
    let env = start_with_admin(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |c| {
            c.admin.allowed_hosts = vec!["pdgate-admin.ops.svc".to_string()];
            // The rogue worker never answers: /add_worker's wait for it stays short.
            c.admin.add_worker_wait_secs = 1;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    let addr = env.router.admin.as_ref().expect("admin").local_addr();
    let rogue = format!("http://127.0.0.1:{}", addr.port() ^ 1);
    let add_q = format!("/add_worker?url={rogue}&worker_type=decode");
    let add_json = format!(r#"{{"role":"decode","url":"{rogue}"}}"#);
    let ip = format!("host: 127.0.0.1:{}\r\n", addr.port());
    // (request line + headers, body, status)
    let table: Vec<(String, String, u16)> = vec![
        // What browsers send: refused on every route, mutations included.
        (
            format!("POST {add_q} HTTP/1.1\r\n{ip}origin: https://evil.example\r\n"),
            String::new(),
            403,
        ),
        (
            format!(
                "POST /workers HTTP/1.1\r\n{ip}origin: null\r\ncontent-type: application/json\r\n"
            ),
            add_json.clone(),
            403,
        ),
        (
            format!("GET /workers HTTP/1.1\r\n{ip}sec-fetch-site: cross-site\r\n"),
            String::new(),
            403,
        ),
        (
            format!("GET /metrics HTTP/1.1\r\n{ip}origin: https://evil.example\r\n"),
            String::new(),
            403,
        ),
        // DNS rebinding: the page's own name as Host.
        (
            format!(
                "POST {add_q} HTTP/1.1\r\nhost: rebind.evil.example:{}\r\n",
                addr.port()
            ),
            String::new(),
            403,
        ),
        (
            "GET /workers HTTP/1.1\r\nhost: evil.example\r\n".to_string(),
            String::new(),
            403,
        ),
        // A form's simple request (no preflight): not JSON.
        (
            format!("POST /workers HTTP/1.1\r\n{ip}content-type: text/plain\r\n"),
            add_json.clone(),
            415,
        ),
        (
            format!("POST /workers HTTP/1.1\r\n{ip}"),
            add_json.clone(),
            415,
        ),
        // Tools: served.
        (format!("GET /workers HTTP/1.1\r\n{ip}"), String::new(), 200),
        (
            format!(
                "GET /metrics HTTP/1.1\r\nhost: localhost:{}\r\n",
                addr.port()
            ),
            String::new(),
            200,
        ),
        (
            format!(
                "GET /list_workers HTTP/1.1\r\nhost: pdgate-admin.ops.svc:{}\r\n",
                addr.port()
            ),
            String::new(),
            200,
        ),
    ];
    for (head, body, want) in &table {
        assert_eq!(raw_status(addr, head, body).await, *want, "{head}");
    }
    // Nothing a refused request asked for happened.
    let (st, _, b) = env.admin("GET", "/list_workers", None, "").await;
    assert_eq!(st, 200);
    assert!(
        !String::from_utf8_lossy(&b).contains(&rogue),
        "{}",
        String::from_utf8_lossy(&b)
    );
    // SGLang's query-string call from a tool still works (no content type, IP Host).
    let st = raw_status(addr, &format!("POST {add_q} HTTP/1.1\r\n{ip}"), "").await;
    assert!(
        st != 403 && st != 415,
        "SGLang's add_worker from a tool passes the guard: {st}"
    );
}

#[tokio::test(crate = "crate::support::rt")]
async fn readiness_detail_is_on_the_admin_listener_only() {
    let env = env_with_token().await;
    env.wait_routable(2, 1).await;
    let prefill_url = env.cluster.prefills[0].url();
    // The admin listener: every worker with its URL (token needed, like every route but
    // /metrics).
    let (st, _, _) = env.admin("GET", "/readiness", None, "").await;
    assert_eq!(st, 401);
    let (st, _, b) = env.admin("GET", "/readiness", Some(TOKEN), "").await;
    assert_eq!(st, 200);
    let v = json(&b);
    assert_eq!(v["ready"], true);
    assert_eq!(v["routable_prefill_ranks"], 2, "{v}");
    let workers = v["workers"].as_array().expect("workers");
    assert_eq!(workers.len(), 2);
    assert!(
        workers.iter().any(|w| w["url"] == prefill_url.as_str()),
        "{v}"
    );
    // The front door: status and counts, nothing internal.
    let resp = env.send("GET", "/readiness", &[], "").await;
    assert_eq!(resp.status(), 200);
    let b = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .expect("body")
        .to_bytes();
    let v = json(&b);
    assert_eq!(v["ready"], true);
    assert_eq!(v["prefill"]["workers"], 1, "{v}");
    assert_eq!(v["decode"]["healthy"], 1, "{v}");
    assert!(!String::from_utf8_lossy(&b).contains(&prefill_url), "{v}");
}
