//! A keep-alive race: the engine closes a pooled leg connection just as the next leg is
//! written on it. The leg client never resends it (the engine may have read it); the
//! dispatcher retries the attempt with fresh rooms — on the same worker when it is the only
//! one — without counting it against the worker's breaker.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::support::common::{self, Env};
use pdgate::pool::BreakerState;
use pdgate::types::{Role, WorkerId};
use pdgate_sim::EngineConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What the fake decode saw.
#[derive(Default)]
struct Seen {
    generate: AtomicU64,
    rids: Mutex<Vec<String>>,
}

/// Reads one request (head and content-length body); `None` at EOF.
async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let l = l.to_ascii_lowercase();
                    l.strip_prefix("content-length:")
                        .map(|v| v.trim().parse().unwrap_or(0))
                })
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let mut chunk = [0u8; 4096];
                let n = s.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let body = buf[end + 4..end + 4 + len].to_vec();
            buf.drain(..end + 4 + len);
            return Some((head, body));
        }
        let mut chunk = [0u8; 4096];
        let n = s.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn answer(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A decode engine that answers health and server info, and `/generate` on every
/// connection's first request; a second `/generate` on a kept-alive connection is read,
/// then the connection is closed without an answer (what an engine whose keep-alive timer
/// fires at that moment does).
async fn racing_decode() -> (String, Arc<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let seen = Arc::new(Seen::default());
    let seen2 = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let seen = seen2.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut generates_here = 0;
                while let Some((head, body)) = read_request(&mut s, &mut buf).await {
                    let path = head.split(' ').nth(1).unwrap_or("").to_string();
                    let out = match path.as_str() {
                        "/health" => answer("{}"),
                        "/server_info" | "/get_server_info" => answer(
                            r#"{"disaggregation_mode":"decode","dp_size":1,"page_size":1,"kv_cache_dtype":"auto"}"#,
                        ),
                        "/abort_request" => answer("{}"),
                        "/generate" => {
                            seen.generate.fetch_add(1, Ordering::SeqCst);
                            let v: serde_json::Value =
                                serde_json::from_slice(&body).unwrap_or_default();
                            let rid = v["rid"].as_str().unwrap_or_default().to_string();
                            seen.rids.lock().unwrap().push(rid);
                            generates_here += 1;
                            if generates_here > 1 {
                                return; // read, then closed: no answer
                            }
                            answer(
                                r#"{"text":"ok","meta_info":{"finish_reason":{"type":"length"}}}"#,
                            )
                        }
                        _ => b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_vec(),
                    };
                    if s.write_all(&out).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}"), seen)
}

/// With retries configured and with none (`retry.max_retries = 0`): a keep-alive race is
/// nobody's fault and does not count against the retries.
#[tokio::test(crate = "crate::support::rt")]
async fn a_keep_alive_race_is_retried_on_the_same_worker_with_fresh_rooms() {
    for max_retries in [2, 0] {
        keep_alive_race(max_retries).await;
    }
}

async fn keep_alive_race(max_retries: u32) {
    let (decode_url, seen) = racing_decode().await;
    let cluster =
        pdgate_sim::SimCluster::spawn(&[common::fast_engine(EngineConfig::prefill(1))], &[])
            .await
            .expect("sim prefill");
    let mut cfg = common::fast_config();
    cfg.retry.max_retries = max_retries;
    common::add_sim_workers(&mut cfg, &cluster);
    cfg.decode.push(pdgate::config::DecodeWorkerConfig {
        url: decode_url,
        model: None,
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let router = pdgate::router::start(
        cfg,
        Some(listener),
        pdgate::dispatch::RngSource::Seeded(1.into()),
    )
    .await
    .expect("router");
    let env = Env {
        cluster,
        router,
        client: common::client(),
    };
    env.wait_routable(1, 1).await;
    let gen = r#"{"text":"hello","sampling_params":{"max_new_tokens":3}}"#;
    for i in 0..3 {
        let (status, _, body) = env.post("/generate", gen).await;
        assert_eq!(
            status,
            200,
            "max_retries {max_retries}, request {i}: {}",
            String::from_utf8_lossy(&body)
        );
    }
    // Request 1 went out on request 0's kept-alive connection and met the race; its retry
    // (attempt 01, fresh rooms) went on a new connection to the same, only, decode.
    let rids = seen.rids.lock().unwrap().clone();
    let retried: Vec<_> = rids.iter().filter(|r| r.ends_with("-01d")).collect();
    assert!(!retried.is_empty(), "no retry reached the decode: {rids:?}");
    for r in &retried {
        let first = r.replace("-01d", "-00d");
        assert!(
            rids.contains(&first),
            "{r} without its first attempt: {rids:?}"
        );
    }
    // Not the engine's fault: its breaker saw no failure.
    let snap = env.router.pool.load();
    let d = snap.worker(Role::Decode, WorkerId(0)).expect("decode");
    assert_eq!(d.shared.breaker.state(), BreakerState::Closed);
}
