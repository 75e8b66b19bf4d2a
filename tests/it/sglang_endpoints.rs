//! SGLang router's front-door routes (`pdgate::server::sglang`): each one with no
//! credentials, a client key and the admin token; its status and body shape; and no
//! engine URL or host in any answer but the worker routes an operator calls with the
//! admin token. Real sockets, sim engines.

use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use pdgate_sim::EngineConfig;
use serde_json::Value;

use crate::support::common::{fast_engine, start_with_admin, Env};

const CLIENT: &str = "sk-client-1";
const ADMIN: &str = "adm-token-1";

fn keys_file(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pdgate-sgl-{}-{test}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let f = dir.join("keys");
    std::fs::write(&f, format!("{CLIENT}\n")).expect("write");
    f
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Who {
    Nobody,
    Client,
    Admin,
}

async fn call(env: &Env, method: &str, path: &str, who: Who) -> (u16, String) {
    let mut h: Vec<(&str, String)> = Vec::new();
    match who {
        Who::Nobody => {}
        Who::Client => h.push(("authorization", format!("Bearer {CLIENT}"))),
        Who::Admin => h.push(("authorization", format!("Bearer {ADMIN}"))),
    }
    let hs: Vec<(&str, &str)> = h.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let resp = tokio::time::timeout(
        Duration::from_secs(20),
        env.send(method, path, &hs, Bytes::new()),
    )
    .await
    .expect("answered in time");
    let (parts, body) = resp.into_parts();
    let b = tokio::time::timeout(Duration::from_secs(20), body.collect())
        .await
        .expect("body in time")
        .expect("body")
        .to_bytes();
    (
        parts.status.as_u16(),
        String::from_utf8_lossy(&b).to_string(),
    )
}

/// Every engine's host:port and bootstrap port, as they could appear in a body.
fn engine_marks(env: &Env) -> Vec<String> {
    let mut out = vec!["127.0.0.1".to_string(), "localhost".to_string()];
    for e in env
        .cluster
        .prefills
        .iter()
        .chain(env.cluster.decodes.iter())
    {
        let url = e.url();
        out.push(url.trim_start_matches("http://").to_string());
        if let Some(p) = e.bootstrap_port() {
            out.push(format!(":{p}"));
        }
    }
    out
}

/// The shape a 200 answer of each route has.
fn shape_ok(path: &str, v: &Value) -> bool {
    match path {
        "/get_server_info" | "/server_info" => {
            v["model_path"].is_string()
                && v["tp_size"].is_number()
                && v["router"]["name"] == "pdgate"
                && v["internal_states"].is_array()
                && v.get("host").is_none()
                && v.get("port").is_none()
                && v.get("disaggregation_bootstrap_port").is_none()
        }
        "/get_model_info" => v["model_path"].is_string() && v["is_generation"] == true,
        "/health_generate" => v["status"] == "ok",
        "/flush_cache" => {
            v["total_workers"] == 2
                && v["failed"].as_array().is_some_and(Vec::is_empty)
                && v["successful"] == serde_json::json!(["prefill-0", "decode-0"])
        }
        "/get_loads" => {
            v["total_workers"] == 2
                && v["loads"][0]["worker_id"] == "prefill-0"
                && v["loads"][1]["worker_id"] == "decode-0"
                && v["loads"][1]["worker_type"] == "decode"
        }
        "/list_workers" => v["urls"].as_array().is_some_and(|a| a.len() == 2),
        "/workers" => v["total"] == 2,
        _ => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_routes_by_credential() {
    let file = keys_file("table");
    let env = start_with_admin(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |c| {
            c.auth.api_keys_file = Some(file.clone());
            c.admin.api_key = Some(ADMIN.to_string());
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    let marks = engine_marks(&env);
    use Who::{Admin, Client, Nobody};
    // (method, path, [status with no credentials, with a client key, with the admin token])
    let table: [(&str, &str, [u16; 3]); 9] = [
        ("GET", "/get_server_info", [401, 200, 401]),
        ("GET", "/server_info", [401, 200, 401]),
        ("GET", "/get_model_info", [401, 200, 401]),
        ("GET", "/health_generate", [401, 200, 401]),
        ("POST", "/flush_cache", [401, 401, 200]),
        ("GET", "/get_loads", [401, 401, 200]),
        ("GET", "/list_workers", [401, 401, 200]),
        ("GET", "/workers", [401, 401, 200]),
        ("POST", "/remove_worker", [401, 401, 400]),
    ];
    for (method, path, want) in table {
        for (who, want) in [Nobody, Client, Admin].into_iter().zip(want) {
            let (st, body) = call(&env, method, path, who).await;
            assert_eq!(st, want, "{method} {path} as {who:?}: {body}");
            let v: Value = serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("{method} {path} as {who:?}: not JSON ({e}): {body}"));
            if st == 200 {
                assert!(shape_ok(path, &v), "{method} {path} as {who:?}: {body}");
            } else {
                assert!(v["error"]["message"].is_string(), "{path}: {body}");
            }
            // The worker routes, with the admin token, are about the URLs the operator
            // gave; nothing else names an engine's address.
            let lists_urls = who == Admin && matches!(path, "/list_workers" | "/workers");
            if !lists_urls {
                for m in &marks {
                    assert!(
                        !body.contains(m.as_str()),
                        "{method} {path} as {who:?} shows {m}: {body}"
                    );
                }
            }
        }
    }
    // A control route refused with a client key says why.
    let (_, body) = call(&env, "POST", "/flush_cache", Client).await;
    assert!(body.contains("admin token"), "{body}");
    // The probe really went through a pair: one request on each engine.
    let s = env.stats();
    assert!(s.requests_total >= 2, "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_routes_without_an_admin_token_say_where_they_are() {
    // An admin listener on loopback without a token: control refused on the front door.
    let env = start_with_admin(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |_| {},
    )
    .await;
    env.wait_routable(1, 1).await;
    for (method, path) in [
        ("POST", "/flush_cache"),
        ("GET", "/get_loads"),
        ("GET", "/list_workers"),
        ("POST", "/add_worker"),
        ("GET", "/workers"),
    ] {
        let (st, body) = call(&env, method, path, Who::Nobody).await;
        assert_eq!(st, 403, "{path}: {body}");
        assert!(body.contains("admin listener"), "{path}: {body}");
        assert!(!body.contains("127.0.0.1"), "{path}: {body}");
    }
    // Without keys, the read-only routes are open.
    let (st, body) = call(&env, "GET", "/get_server_info", Who::Nobody).await;
    assert_eq!(st, 200, "{body}");
    // No admin listener at all: 404, naming where pdgate serves them.
    let env2 = crate::support::common::start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |_| {},
    )
    .await;
    env2.wait_routable(1, 1).await;
    let (st, body) = call(&env2, "POST", "/flush_cache", Who::Nobody).await;
    assert_eq!(st, 404, "{body}");
    assert!(body.contains("admin listener"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_worker_on_the_front_door_waits_until_the_worker_takes_traffic() {
    let env = start_with_admin(
        vec![fast_engine(EngineConfig::prefill(1))],
        vec![fast_engine(EngineConfig::decode(1))],
        |c| {
            c.admin.api_key = Some(ADMIN.to_string());
            c.admin.add_worker_wait_secs = 1;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    let extra = pdgate_sim::spawn(fast_engine(EngineConfig::decode(1)))
        .await
        .expect("engine");
    let (st, body) = call(
        &env,
        "POST",
        &format!("/add_worker?url={}&worker_type=decode", extra.url()),
        Who::Admin,
    )
    .await;
    assert_eq!(st, 200, "{body}");
    assert!(
        body.starts_with("Successfully added decode worker"),
        "{body}"
    );
    // Answered once it takes traffic: routable now, not later.
    let snap = env.router.pool.load();
    assert_eq!(snap.decode_routable.len(), 2, "{body}");
    // A worker that never answers: registered, said plainly, after the bounded wait.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = dead.local_addr().expect("addr").port();
    drop(dead);
    let started = std::time::Instant::now();
    let (st, body) = call(
        &env,
        "POST",
        &format!("/add_worker?url=http://127.0.0.1:{port}&worker_type=decode"),
        Who::Admin,
    )
    .await;
    assert_eq!(st, 202, "{body}");
    assert!(body.contains("not yet checked"), "{body}");
    assert!(started.elapsed() < Duration::from_secs(10));
    extra.shutdown();
}
