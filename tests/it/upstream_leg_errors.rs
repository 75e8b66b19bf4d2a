//! The lean leg client's errors, cancellation and idle pool, against hand-written
//! HTTP/1.1 servers on real sockets (see `upstream_support`). Every test is bounded.

use crate::support::upstream_support;

use upstream_support::*;

// ---------------------------------------------------------------- errors

/// Malformed or cut answers on a new connection: the documented error, where expected,
/// no retry (a retry would wait forever on a connection nobody answers), and the
/// connection closed by the client even while it still holds the body.
#[tokio::test(crate = "crate::support::rt")]
async fn malformed_and_cut_answers_are_errors() {
    type Check = fn(&LegError) -> bool;
    let mut big_head = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
    big_head.resize(70 * 1024, b'a');
    let mut many = b"HTTP/1.1 200 OK\r\n".to_vec();
    for k in 0..65 {
        many.extend_from_slice(format!("x-h{k}: v\r\n").as_bytes());
    }
    many.extend_from_slice(b"content-length: 0\r\n\r\n");
    let long_line = [CHUNKED, &b"1;"[..], &[b'e'; 5000][..]].concat();
    let ch = |rest: &[u8]| [CHUNKED, rest].concat();
    use ProtocolError as P;
    #[rustfmt::skip]
    let cases: Vec<(&str, Vec<u8>, bool, At, Check)> = vec![
        ("bad version", b"HTP/1.1 200 OK\r\n\r\n".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::Head(httparse::Error::Version)))),
        ("bad status code", b"HTTP/1.1 2x0 OK\r\n\r\n".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::Head(httparse::Error::Status)))),
        ("status below 100", b"HTTP/1.1 099 Low\r\n\r\n".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::Status(99)))),
        ("not http at all", b"SSH-2.0-OpenSSH\r\n\r\n".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::Head(_)))),
        ("bad content-length", b"HTTP/1.1 200 OK\r\ncontent-length: abc\r\n\r\n".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::ContentLength(v)) if v == "abc")),
        ("negative content-length", b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::ContentLength(_)))),
        ("conflicting content-lengths", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\nhello".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::ConflictingContentLength(5, 6)))),
        ("control byte in a header value", b"HTTP/1.1 200 OK\r\nx-a: a\x01b\r\ncontent-length: 0\r\n\r\n".to_vec(), false, At::Send, |e| matches!(e, LegError::Protocol(P::Head(httparse::Error::HeaderValue)))),
        ("more than 64 headers", many, false, At::Send, |e| matches!(e, LegError::Protocol(P::Head(httparse::Error::TooManyHeaders)))),
        ("head larger than 64 KiB", big_head, false, At::Send, |e| matches!(e, LegError::Protocol(P::HeadTooLarge(65536)))),
        ("EOF before any answer", vec![], true, At::Send, |e| matches!(e, LegError::ClosedAfterWrite { reused: false, source: None })),
        ("EOF in the head", b"HTTP/1.1 200 OK\r\ncontent-".to_vec(), true, At::Send, closed_early),
        ("bad chunk size", ch(b"zz\r\n"), false, At::Body, |e| matches!(e, LegError::Protocol(P::ChunkSize(v)) if v == "zz")),
        ("chunk size too long", ch(b"1234567890abcdef0\r\n"), false, At::Body, |e| matches!(e, LegError::Protocol(P::ChunkSize(_)))),
        ("chunk line too long", long_line, false, At::Body, |e| matches!(e, LegError::Protocol(P::ChunkLineTooLong(4096)))),
        ("missing CRLF after chunk data", ch(b"5\r\nhelloXX0\r\n\r\n"), false, At::Body, |e| matches!(e, LegError::Protocol(P::ChunkDataEnd))),
        ("EOF in a length body", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello".to_vec(), true, At::Body, closed_early),
        ("EOF in a chunk", ch(b"5\r\nhel"), true, At::Body, closed_early),
        ("EOF before the terminal chunk", ch(b"2\r\nok\r\n"), true, At::Body, closed_early),
        ("EOF in the trailers", ch(b"0\r\nx-t: 1\r\n"), true, At::Body, closed_early),
    ];
    for (name, answer, close, at, want) in cases {
        bounded(async {
            let m = Manual::new().await;
            let (mut c, _, r) = m.exchange(leg(&m.host, b"{}"), &answer, close).await;
            let mut _held = None;
            let e = match (at, r) {
                (At::Send, Err(e)) => e,
                (At::Body, Ok(resp)) => {
                    let mut body = resp.into_body();
                    let e = data_until(&mut body, usize::MAX).await.err();
                    _held = Some(body);
                    e.unwrap_or_else(|| panic!("{name}: the body ended without an error"))
                }
                (_, r) => panic!("{name}: wanted an error at {at:?}, got {r:?}"),
            };
            assert!(want(&e), "{name}: {e:?}");
            if let LegError::Protocol(p) = &e {
                // The cause is kept as the error's source, and named once in its chain.
                let source = std::error::Error::source(&e).map(|s| s.to_string());
                assert_eq!(source, Some(p.to_string()), "{name}");
                assert_eq!(error_chain(&e), e.to_string(), "{name}");
            }
            assert!(c.request().await.is_none(), "{name}: connection left open");
            assert_eq!(m.host.idle_count(), 0, "{name}");
        })
        .await;
    }
}

#[tokio::test(crate = "crate::support::rt")]
async fn connect_refused_is_a_connect_error() {
    bounded(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let host = host_for(addr);
        let e = call(&upstream(|_| {}), &host).await.expect_err("refused");
        assert!(matches!(e, LegError::Connect { .. }), "{e:?}");
        assert_eq!(host.idle_count(), 0);
    })
    .await;
}

/// A background call to a port nobody listens on fails as `Transport`, which keeps
/// hyper's error as its source (down to the `io::Error`), and says why in its message.
#[tokio::test(crate = "crate::support::rt")]
async fn background_call_errors_keep_their_cause() {
    bounded(async {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let base = parse_base_url(&format!("http://{addr}")).unwrap();
        let e = upstream(|_| {})
            .get(&base, "/health", Duration::from_secs(2))
            .await
            .expect_err("refused");
        assert!(matches!(e, CallError::Transport(_)), "{e:?}");
        let mut cause = std::error::Error::source(&e);
        let mut io_kind = None;
        while let Some(c) = cause {
            if let Some(io) = c.downcast_ref::<std::io::Error>() {
                io_kind = Some(io.kind());
            }
            cause = c.source();
        }
        assert_eq!(
            io_kind,
            Some(std::io::ErrorKind::ConnectionRefused),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(msg.starts_with("connect/transport error: "), "{msg}");
        assert_eq!(msg.matches("refused").count(), 1, "{msg}");
        assert_eq!(error_chain(&e), msg);
    })
    .await;
}

async fn assert_refused(answer: &[u8]) {
    let m = Manual::new().await;
    let r = m.exchange(leg(&m.host, b"{}"), answer, false).await.2;
    let r = r.map(|r| r.status());
    assert!(matches!(r, Err(LegError::Protocol(_))), "{r:?}");
}

/// A complete head larger than the 64 KiB limit is refused like an incomplete one.
#[tokio::test(crate = "crate::support::rt")]
async fn complete_head_larger_than_limit_is_refused() {
    let mut head = b"HTTP/1.1 200 OK\r\nx-big: ".to_vec();
    head.resize(100 * 1024, b'a');
    head.extend_from_slice(b"\r\ncontent-length: 0\r\n\r\n");
    bounded(assert_refused(&head)).await;
}

/// `Content-Length` is `1*DIGIT`; a sign is not a length.
#[tokio::test(crate = "crate::support::rt")]
async fn signed_content_length_is_refused() {
    bounded(assert_refused(
        b"HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\nhello",
    ))
    .await;
}

/// `keep_headers = false` drops the answer's headers but not what they mean for framing
/// and reuse.
#[tokio::test(crate = "crate::support::rt")]
async fn answer_headers_kept_only_when_asked() {
    #[rustfmt::skip]
    let cases: &[(&[u8], &[&str], bool)] = &[
        (b"HTTP/1.1 200 OK\r\nX-A: 1\r\nx-a: 2\r\ncontent-length: 2\r\n\r\nok", &["1", "2"], true),
        (b"HTTP/1.1 200 OK\r\nx-a: 3\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", &["3"], true),
        (b"HTTP/1.1 200 OK\r\nx-a: 4\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok", &["4"], false),
    ];
    for &(answer, values, reused) in cases {
        for keep in [true, false] {
            bounded(async {
                let m = Manual::new().await;
                let mut req = leg(&m.host, b"{}");
                req.keep_headers = keep;
                let resp = m.exchange(req, answer, false).await.2.expect("answer");
                let seen: Vec<_> = resp.headers().get_all("x-a").iter().collect();
                let want: &[&str] = if keep { values } else { &[] };
                assert_eq!(seen, want, "keep_headers={keep}");
                assert_eq!(resp.headers().is_empty(), !keep);
                assert_eq!(body_bytes(resp).await, b"ok");
                assert_eq!(m.host.idle_count(), usize::from(reused), "{keep}");
            })
            .await;
        }
    }
}

// ---------------------------------------------------------------- cancellation

/// Dropping the leg (its send future or its body) before the answer's end closes the
/// connection at once, and it is not pooled.
#[tokio::test(crate = "crate::support::rt")]
async fn dropping_a_leg_early_closes_its_connection() {
    // (answer written, data frames read before the drop, drop the send future instead)
    #[rustfmt::skip]
    let cases: &[(&str, &[u8], &[u8], bool)] = &[
        ("send future, before the head", b"", b"", true),
        ("send future, head in part", b"HTTP/1.1 200 OK\r\n", b"", true),
        ("body, unpolled, partly sent", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", b"", false),
        ("body, all buffered but unpolled", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", b"", false),
        ("body, mid length", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", b"hello", false),
        ("body, mid chunked", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", b"hello", false),
        ("body, close-delimited", b"HTTP/1.1 200 OK\r\n\r\nhello", b"hello", false),
    ];
    for &(name, answer, read, drop_send) in cases {
        bounded(async {
            let m = Manual::new().await;
            let pending = m.spawn(b"{}");
            let mut c = m.accept().await;
            c.request().await.expect("request");
            c.send(answer).await;
            if drop_send {
                tokio::task::yield_now().await;
                pending.abort();
                assert!(pending.await.unwrap_err().is_cancelled(), "{name}");
            } else {
                let mut body = pending.await.unwrap().expect(name).into_body();
                assert_eq!(
                    data_until(&mut body, read.len()).await.unwrap(),
                    read,
                    "{name}"
                );
                assert!(!body.is_end_stream(), "{name}");
                drop(body);
            }
            assert!(
                c.request().await.is_none(),
                "{name}: the server did not see the close"
            );
            assert_eq!(m.host.idle_count(), 0, "{name}");
        })
        .await;
    }
}

// ---------------------------------------------------------------- the request

/// What the engine receives: request line, host, JSON content type, exact length and
/// body (1 MiB too, which takes several writes), forwarded headers once each, and none of
/// the headers the client owns taken from the forward map.
#[tokio::test(crate = "crate::support::rt")]
async fn request_is_written_exactly() {
    let mib: Vec<u8> = (0..1 << 20)
        .map(|i: u32| b"{\"x\":[1,2]}"[(i % 11) as usize])
        .collect();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("/generate", b"{\"text\":\"hi\"}".to_vec()),
        ("/v1/chat/completions?x=1", vec![]),
        ("/generate", mib),
    ];
    let mut fwd = HeaderMap::new();
    fwd.insert("x-request-id", HeaderValue::from_static("rid-1"));
    fwd.insert(AUTHORIZATION, HeaderValue::from_static("Bearer k"));
    fwd.append("x-multi", HeaderValue::from_static("a"));
    fwd.append("x-multi", HeaderValue::from_static("b"));
    fwd.insert(HOST, HeaderValue::from_static("evil:1"));
    fwd.insert(CONTENT_LENGTH, HeaderValue::from_static("999"));
    fwd.insert(CONTENT_TYPE, HeaderValue::from_static("text/plain"));
    fwd.insert("transfer-encoding", HeaderValue::from_static("chunked"));
    fwd.insert(CONNECTION, HeaderValue::from_static("close"));
    let mut lines = Vec::new();
    header_lines(&fwd, &mut lines);
    for (path, body) in cases {
        bounded(async {
            let m = Manual::new().await;
            let port = m.listener.local_addr().unwrap().port();
            let req = LegRequest::post_json(&m.host, path, body.clone(), &lines);
            let (_c, r, resp) = m.exchange(req, OK2, false).await;
            assert_eq!(body_bytes(resp.unwrap()).await, b"ok");
            let line = r.head.split("\r\n").next().unwrap();
            assert_eq!(line, format!("POST {path} HTTP/1.1"));
            let host = format!("127.0.0.1:{port}");
            let len = body.len().to_string();
            let want: &[(&str, &[&str])] = &[
                ("host", &[&host]),
                ("content-type", &["application/json"]),
                ("content-length", &[&len]),
                ("x-request-id", &["rid-1"]),
                ("authorization", &["Bearer k"]),
                ("x-multi", &["a", "b"]),
                ("transfer-encoding", &[]),
                ("connection", &[]),
            ];
            for (name, values) in want {
                assert_eq!(r.values(name), *values, "{path}: {name}");
            }
            assert_eq!(r.head.matches("\r\n").count(), 2 + 7, "{path}: {}", r.head);
            assert!(r.body == body, "{path}: body differs ({})", r.body.len());
        })
        .await;
    }
}

// ---------------------------------------------------------------- the idle pool

/// `sweep` closes connections idle for the given time; a zero idle timeout in the config
/// means a pooled connection is never reused.
#[tokio::test(crate = "crate::support::rt")]
async fn idle_connections_age_out() {
    bounded(async {
        let mut srv = serve(|c| c.answer_all(OK2)).await;
        let up = upstream(|_| {});
        call(&up, &srv.host).await.unwrap();
        assert_eq!(srv.host.idle_count(), 1);
        srv.host.sweep(Duration::from_secs(3600));
        assert_eq!(srv.host.idle_count(), 1, "young connections stay");
        srv.host.sweep(Duration::ZERO);
        assert_eq!(srv.host.idle_count(), 0);
        assert_eq!(srv.closed().await, 0, "the server sees the close");
        call(&up, &srv.host).await.unwrap();
        assert_eq!(srv.accepted(), 2);

        let mut srv = serve(|c| c.answer_all(OK2)).await;
        let up = upstream(|c| c.pool_idle_timeout_secs = 0);
        call(&up, &srv.host).await.unwrap();
        call(&up, &srv.host).await.unwrap();
        assert_eq!(srv.accepted(), 2);
        assert_eq!(srv.closed().await, 0);
    })
    .await;
}

/// Two concurrent legs open two connections; when both finish, at most `max_idle` stay
/// pooled and the others are closed.
#[tokio::test(crate = "crate::support::rt")]
async fn max_idle_per_host_bounds_the_pool() {
    for (max_idle, idle) in [(0usize, 0usize), (1, 1), (256, 2)] {
        bounded(async {
            let gate = Arc::new(tokio::sync::Barrier::new(2));
            let mut srv = serve(move |mut c| {
                let gate = gate.clone();
                async move {
                    if c.request().await.is_some() {
                        if c.i < 2 {
                            gate.wait().await;
                        }
                        c.send(OK2).await;
                        c.answer_all(OK2).await;
                    }
                }
            })
            .await;
            let up = upstream(|c| c.pool_max_idle_per_host = max_idle);
            let a = spawn_leg(&up, &srv.host, leg(&srv.host, b"{}"));
            let b = spawn_leg(&up, &srv.host, leg(&srv.host, b"{}"));
            for h in [a, b] {
                assert_eq!(body_bytes(h.await.unwrap().unwrap()).await, b"ok");
            }
            assert_eq!(srv.accepted(), 2, "max_idle={max_idle}");
            assert_eq!(srv.host.idle_count(), idle, "max_idle={max_idle}");
            for _ in idle..2 {
                srv.closed().await;
            }
            // The next leg reuses a pooled connection when there is one.
            call(&up, &srv.host).await.unwrap();
            let want = if idle > 0 { 2 } else { 3 };
            assert_eq!(srv.accepted(), want, "max_idle={max_idle}");
        })
        .await;
    }
}

// ---------------------------------------------------------------- answer framing

/// An engine that answers before it has read the whole request (a 413 or 400 on the head
/// alone) and closes: its answer is the leg's result, not the write's reset, on a new
/// connection as on a kept-alive one, and the connection is not pooled (the request was
/// never written whole). The body (32 MiB) is more than the socket buffers hold, so the
/// client's write is still going when the engine closes.
#[tokio::test(crate = "crate::support::rt")]
async fn an_early_answer_is_reported_not_the_failed_write() {
    let big = Arc::new(vec![b' '; 32 << 20]);
    #[rustfmt::skip]
    let cases: &[(u16, &[u8], &str)] = &[
        (413, b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-length: 20\r\nconnection: close\r\n\r\n{\"error\":\"too big\"}\n", "{\"error\":\"too big\"}\n"),
        (400, b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n5\r\nbad\r\n\r\n0\r\n\r\n", "bad\r\n"),
    ];
    for &(status, answer, want) in cases {
        for reused in [false, true] {
            bounded(async {
                let srv = serve(move |mut c| async move {
                    if reused && c.i == 0 {
                        c.request().await.expect("first request");
                        c.send(OK2).await;
                    }
                    if c.head_only().await {
                        c.send(answer).await;
                        c.close(false);
                    }
                })
                .await;
                let up = upstream(|_| {});
                if reused {
                    assert_eq!(call(&up, &srv.host).await.unwrap().1, b"ok");
                }
                let resp = up
                    .send_leg(&srv.host, &leg(&srv.host, &big))
                    .await
                    .unwrap_or_else(|e| panic!("{status} reused={reused}: {e}"));
                assert_eq!(resp.status().as_u16(), status, "reused={reused}");
                assert_eq!(body_bytes(resp).await, want.as_bytes(), "{status}");
                assert_eq!(
                    srv.accepted(),
                    1,
                    "{status} reused={reused}: no second connection"
                );
                assert_eq!(srv.host.idle_count(), 0, "{status} reused={reused}");
            })
            .await;
        }
    }
}

/// When the request cannot be written and nothing was answered, the leg fails as a write
/// error (the engine cannot have read it) without waiting for an answer.
#[tokio::test(crate = "crate::support::rt")]
async fn a_failed_write_without_an_answer_is_a_write_error() {
    bounded(async {
        let srv = serve(|mut c| async move {
            if c.head_only().await {
                c.close(true);
            }
        })
        .await;
        let big = vec![b' '; 32 << 20];
        let e = upstream(|_| {})
            .send_leg(&srv.host, &leg(&srv.host, &big))
            .await
            .expect_err("reset mid-body");
        assert!(matches!(e, LegError::Write(_)), "{e:?}");
        assert!(!e.engine_may_have_read(), "{e:?}");
    })
    .await;
}

/// An answer with both Transfer-Encoding and Content-Length is framed by the former, and
/// the length is not kept for the client (RFC 9112 §6.3).
#[tokio::test(crate = "crate::support::rt")]
async fn a_length_beside_transfer_encoding_is_dropped() {
    #[rustfmt::skip]
    let answers: &[&[u8]] = &[
        b"HTTP/1.1 200 OK\r\ncontent-length: 999\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\nx-a: 1\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    ];
    for answer in answers {
        bounded(async {
            let m = Manual::new().await;
            let resp = m.exchange(leg(&m.host, b"{}"), answer, false).await.2;
            let resp = resp.expect("answer");
            assert_eq!(resp.headers().get(CONTENT_LENGTH), None);
            assert_eq!(resp.headers()["x-a"], "1");
            assert_eq!(body_bytes(resp).await, b"ok");
        })
        .await;
    }
}
