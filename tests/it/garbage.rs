//! The front door under arbitrary bytes: whatever a client sends on a raw connection, the
//! router answers with an HTTP error or closes, never sends a leg for it, and keeps serving.

use crate::support::common;

use std::time::Duration;

use common::start;
use pdgate_sim::EngineConfig;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bytes a client might send: random, or HTTP-ish (a request line, headers, an h2 preface)
/// with damage.
fn arb_garbage() -> impl Strategy<Value = Vec<u8>> {
    let pieces = prop::sample::select(vec![
        &b"POST /generate HTTP/1.1\r\n"[..],
        b"GET / HTTP/1.1\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
        b"host: x\r\n",
        b"content-length: 5\r\n",
        b"content-length: -1\r\n",
        b"content-length: 99999999999999999999\r\n",
        b"transfer-encoding: chunked\r\n",
        b"content-type: application/json\r\n",
        b"\r\n",
        b"{\"text\":\"hi\"}",
        b"zz\r\n",
        b"\x00\xff\xfe",
        b" ",
    ]);
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        prop::collection::vec(pieces.clone(), 0..12).prop_map(|p| p.concat()),
        (
            prop::collection::vec(pieces, 1..10),
            any::<prop::sample::Index>(),
            any::<u8>()
        )
            .prop_map(|(p, at, b)| {
                let mut v = p.concat();
                let i = at.index(v.len());
                v[i] = b;
                v
            }),
    ]
}

#[test]
fn arbitrary_bytes_never_reach_an_engine_and_the_router_keeps_serving() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let env = rt.block_on(async {
        let env = start(
            vec![EngineConfig::prefill(1)],
            vec![EngineConfig::decode(1)],
            |c| {
                c.server.header_read_timeout_secs = 2;
                c.server.body_read_timeout_secs = 2;
            },
        )
        .await;
        env.wait_routable(1, 1).await;
        env
    });
    let addr = env.addr();
    let cfg = ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    proptest!(cfg, |(garbage in arb_garbage())| {
        let answer = rt.block_on(async {
            let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
            let _ = s.write_all(&garbage).await;
            let _ = s.shutdown().await; // the client is done sending
            let mut out = Vec::new();
            // Bounded: the router closes (or answers and closes) once the client is done.
            let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out));
            read.await.map(|_| out)
        });
        let answer = answer.map_err(|_| TestCaseError::fail("the router never closed"))?;
        if !answer.is_empty() {
            // An answer, if any, is HTTP (h1 status line, or h2 frames after a preface).
            prop_assert!(
                answer.starts_with(b"HTTP/1.") || garbage.starts_with(b"PRI * HTTP/2.0"),
                "{}", String::from_utf8_lossy(&answer)
            );
        }
    });
    let stats = rt.block_on(async {
        // Still serving, and no garbage was ever sent on as a leg.
        let (status, _, body) = env
            .post(
                "/generate",
                r#"{"text":"hi","sampling_params":{"max_new_tokens":2}}"#,
            )
            .await;
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        env.settled_stats().await
    });
    assert_eq!(
        stats.requests_total, 2,
        "only the last request reached the engines: {stats:?}"
    );
}
