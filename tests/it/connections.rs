//! Connections are bounded: at most `server.max_connections` are served at once (one more
//! gets a whole `503 too_many_connections` answer and is closed), idle HTTP/1 connections
//! are closed by the header timer, and idle HTTP/2 (h2c) connections — with no stream, or
//! after their last one — by `server.idle_timeout_secs`. Many idle connections, both
//! protocols.

use crate::support::common;

use std::time::Duration;

use bytes::Bytes;
use common::{start, Env};
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::{TokioExecutor, TokioIo};
use pdgate_sim::EngineConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMIT: usize = 8;
/// Generous bound for the server to act (its own timers are 1–2 s).
const BOUND: Duration = Duration::from_secs(15);

async fn env() -> Env {
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig::decode(1)],
        |c| {
            c.server.max_connections = LIMIT;
            c.server.header_read_timeout_secs = 2;
            c.server.idle_timeout_secs = 1;
        },
    )
    .await;
    env.wait_routable(1, 1).await;
    env
}

/// `GET /health` on a kept-alive HTTP/1.1 connection; returns the status.
async fn health_http1(s: &mut TcpStream) -> u16 {
    s.write_all(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 1024];
    loop {
        let n = s.read(&mut chunk).await.expect("read");
        assert!(n > 0, "closed before an answer");
        buf.extend_from_slice(&chunk[..n]);
        let text = String::from_utf8_lossy(&buf).to_string();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length: ")
                        .map(|v| v.trim().parse().expect("length"))
                })
                .expect("content-length");
            if body.len() >= len {
                return head[9..12].parse().expect("status");
            }
        }
    }
}

/// Reads until the server closes the connection (bounded); returns what came.
async fn until_closed(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(BOUND, s.read_to_end(&mut out))
        .await
        .expect("the server closed the connection in time")
        .expect("read");
    out
}

/// The connection beyond the limit is answered 503 and closed, having sent nothing.
async fn assert_refused(env: &Env) {
    let mut extra = TcpStream::connect(env.addr()).await.expect("connect");
    let answer = String::from_utf8(until_closed(&mut extra).await).expect("ascii");
    assert!(answer.starts_with("HTTP/1.1 503 "), "{answer}");
    assert!(answer.contains("too_many_connections"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
}

#[tokio::test(crate = "crate::support::rt")]
async fn http1_connections_are_bounded_and_idle_ones_closed() {
    let env = env().await;
    let mut idle = Vec::new();
    for _ in 0..LIMIT {
        let mut s = TcpStream::connect(env.addr()).await.expect("connect");
        assert_eq!(health_http1(&mut s).await, 200);
        idle.push(s);
    }
    assert_refused(&env).await;
    // The header timer closes each idle kept-alive connection...
    for s in &mut idle {
        assert!(until_closed(s).await.is_empty());
    }
    // ...which frees their places.
    let mut s = TcpStream::connect(env.addr()).await.expect("connect");
    assert_eq!(health_http1(&mut s).await, 200);
}

#[tokio::test(crate = "crate::support::rt")]
async fn silent_connections_count_and_are_closed() {
    let env = env().await;
    let mut silent = Vec::new();
    for _ in 0..LIMIT {
        silent.push(TcpStream::connect(env.addr()).await.expect("connect"));
    }
    // Accepted connections hold their place even before their first byte (they are
    // accepted in the order they connected, so the next one is the one beyond the limit).
    assert_refused(&env).await;
    for s in &mut silent {
        assert!(until_closed(s).await.is_empty());
    }
    let mut s = TcpStream::connect(env.addr()).await.expect("connect");
    assert_eq!(health_http1(&mut s).await, 200);
}

/// An h2c (prior knowledge) connection: its request handle and a task that ends when the
/// server closes the connection.
async fn h2c(
    env: &Env,
) -> (
    hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    tokio::task::JoinHandle<()>,
) {
    let tcp = TcpStream::connect(env.addr()).await.expect("connect");
    let (send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (send, task)
}

async fn health_h2(
    send: &mut hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    env: &Env,
) -> u16 {
    let req = http::Request::get(env.url("/health"))
        .body(Empty::<Bytes>::new())
        .expect("request");
    let resp = send.send_request(req).await.expect("answer");
    let status = resp.status().as_u16();
    resp.into_body().collect().await.expect("body");
    status
}

#[tokio::test(crate = "crate::support::rt")]
async fn h2c_connections_are_bounded_and_idle_ones_closed() {
    let env = env().await;
    let mut conns = Vec::new();
    for i in 0..LIMIT {
        let (mut send, task) = h2c(&env).await;
        // Half of them used once, half never open a stream.
        if i % 2 == 0 {
            assert_eq!(health_h2(&mut send, &env).await, 200);
        }
        conns.push((send, task));
    }
    assert_refused(&env).await;
    // Every one of them is closed by the server once idle (GOAWAY), used or not.
    for (_, task) in conns {
        tokio::time::timeout(BOUND, task)
            .await
            .expect("idle h2c connection closed by the server")
            .expect("task");
    }
    let (mut send, _task) = h2c(&env).await;
    assert_eq!(health_h2(&mut send, &env).await, 200);
}

#[tokio::test(crate = "crate::support::rt")]
async fn an_h2c_connection_with_a_stream_open_is_not_idle() {
    // A stream that lasts longer than the idle timeout keeps its connection.
    let env = start(
        vec![EngineConfig::prefill(1)],
        vec![EngineConfig {
            faults: pdgate_sim::Faults {
                decode_extra_itl_ms: 300,
                ..Default::default()
            },
            ..EngineConfig::decode(1)
        }],
        |c| c.server.idle_timeout_secs = 1,
    )
    .await;
    env.wait_routable(1, 1).await;
    let tcp = TcpStream::connect(env.addr()).await.expect("connect");
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
            .await
            .expect("h2 handshake");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    // 8 tokens, 300 ms apart: about 2.4 s, beyond the 1 s idle timeout.
    let req = http::Request::post(env.url("/generate"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(Bytes::from_static(
            br#"{"text":"hi","sampling_params":{"max_new_tokens":8},"stream":true}"#,
        )))
        .expect("request");
    let resp = send.send_request(req).await.expect("answer");
    assert_eq!(resp.status(), 200);
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("whole stream")
        .to_bytes();
    let (events, done) = common::sse_events(&body);
    assert!(done, "the stream ended normally");
    assert!(
        events.iter().all(|e| e.get("error").is_none()),
        "{events:?}"
    );
}
