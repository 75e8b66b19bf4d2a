//! The lean leg client (`pdgate::upstream`) against hand-written HTTP/1.1 servers on real
//! sockets (127.0.0.1, port 0): framing, connection reuse, when a request may be sent again,
//! errors, cancellation and the idle pool. Every test is bounded by [`bounded`].
//!
//! Two kinds of server: [`serve`] runs a handler per accepted connection and counts them
//! (for reuse counts), and [`Manual`] lets the test accept and drive one connection step by
//! step (for exact framing scripts).

use crate::support::upstream_support;

use upstream_support::*;

// ---------------------------------------------------------------- framing scripts

enum Step {
    /// The server writes these bytes.
    W(Vec<u8>),
    /// The server writes these bytes, in pieces of this size, while the next step runs.
    Trickle(Vec<u8>, usize),
    /// The server shuts its side down (FIN).
    Close,
    /// The head arrives with this status.
    Head(u16),
    /// Data frames adding up to these bytes; then `is_end_stream()`, if given, without
    /// another poll.
    Data(Vec<u8>, Option<bool>),
    /// No more frames.
    End,
}
use Step::*;

fn w(b: &[u8]) -> Step {
    W(b.to_vec())
}
fn data(b: &[u8], end: bool) -> Step {
    Data(b.to_vec(), Some(end))
}
fn trickled(b: &[u8]) -> Step {
    Trickle(b.to_vec(), 1)
}

#[rustfmt::skip]
fn scripts() -> Vec<(&'static str, Vec<Step>, bool)> {
    let big: Vec<u8> = (0..300_000u32).map(|i| b'a' + (i % 26) as u8).collect();
    let big_head = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", big.len());
    let x31 = [b'x'; 31];
    let one_xx = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n\
        HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
    vec![
        ("length: whole in one write", vec![w(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"), Head(200), data(b"hello", true), End], true),
        ("length: split across writes", vec![w(b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\n\r\n"), Head(201), w(b"hello"), data(b"hello", false), w(b" "), data(b" ", false), w(b"world"), data(b"world", true), End], true),
        ("length: head and body trickled", vec![w(b"HTTP/1.1 200 OK\r\ncontent-len"), trickled(b"gth: 3\r\nx-a: b\r\n\r\n"), Head(200), trickled(b"abc"), Data(b"abc".to_vec(), None), End], true),
        ("length: large body", vec![W(big_head.into_bytes()), Head(200), Trickle(big.clone(), 16 * 1024), Data(big, Some(true)), End], true),
        ("length: zero", vec![w(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), Head(200), data(b"", true), End], true),
        ("204 no content", vec![w(b"HTTP/1.1 204 No Content\r\n\r\n"), Head(204), data(b"", true), End], true),
        ("error status with a body", vec![w(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\n\r\nbusy"), Head(503), data(b"busy", true), End], true),
        ("chunked: separate writes, extensions, uppercase hex, trailers", vec![w(CHUNKED), Head(200), w(b"5;foo=bar\r\nhello\r\n"), data(b"hello", false), w(b"A\r\n0123456789\r\n"), data(b"0123456789", false), w(b"1F;a=1;b=\"q\"\r\n"), w(&x31), w(b"\r\n"), data(&x31, false), w(b"0\r\nx-trailer: 1\r\nx-other: two\r\n\r\n"), End], true),
        ("chunked: terminal chunk with the last data", vec![w(CHUNKED), Head(200), w(b"5\r\nhello\r\n"), data(b"hello", false), w(b"6\r\n world\r\n0\r\n\r\n"), data(b" world", true), End], true),
        ("chunked: trailers with the last data", vec![w(CHUNKED), Head(200), w(b"3\r\nabc\r\n0;end=1\r\nx-t: 1\r\n\r\n"), data(b"abc", true), End], true),
        ("chunked: whole answer in one write", vec![W([CHUNKED, b"3\r\nabc\r\n0\r\n\r\n"].concat()), Head(200), data(b"abc", true), End], true),
        ("chunked: empty", vec![W([CHUNKED, b"0\r\n\r\n"].concat()), Head(200), data(b"", true), End], true),
        ("chunked: trickled", vec![w(CHUNKED), Head(200), trickled(b"4;x=y\r\nwiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nx-a: b\r\n\r\n"), Data(b"wikipedia in\r\n\r\nchunks.".to_vec(), None), End], true),
        ("chunked: trailers split across writes", vec![w(CHUNKED), Head(200), w(b"2\r\nok\r\n"), data(b"ok", false), w(b"0\r\n"), w(b"x-t: 1\r\n"), w(b"\r\n"), End], true),
        ("close-delimited", vec![w(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nstream"), Head(200), data(b"stream", false), w(b"ing"), data(b"ing", false), Close, End], false),
        ("transfer-encoding not chunked is close-delimited", vec![w(b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nzz"), Head(200), data(b"zz", false), Close, End], false),
        ("connection: close with length", vec![w(b"HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 2\r\n\r\nok"), Head(200), data(b"ok", true), End], false),
        ("connection: close, chunked", vec![w(b"HTTP/1.1 200 OK\r\nconnection: keep-alive, close\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"), Head(200), data(b"ok", true), End], false),
        ("http/1.0 with length", vec![w(b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok"), Head(200), data(b"ok", true), End], false),
        ("http/1.0 keep-alive", vec![w(b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok"), Head(200), data(b"ok", true), End], true),
        ("length: extra bytes after the body", vec![w(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokJUNK"), Head(200), data(b"ok", true), End], false),
        ("chunked: extra bytes after the end", vec![W([CHUNKED, b"2\r\nok\r\n0\r\n\r\nJUNK"].concat()), Head(200), data(b"ok", true), End], false),
        ("1xx: 100 Continue in its own write", vec![w(b"HTTP/1.1 100 Continue\r\n\r\n"), w(OK2), Head(200), data(b"ok", true), End], true),
        ("1xx: 100 and 103 with the answer", vec![w(one_xx), Head(200), data(b"ok", true), End], true),
        ("1xx: trickled", vec![trickled(one_xx), Head(200), Data(b"ok".to_vec(), None), End], true),
    ]
}

/// Runs each script on a fresh server, then checks that the next leg goes on the same
/// connection exactly when `reused`.
#[tokio::test(crate = "crate::support::rt")]
async fn framing_scripts() {
    for (name, steps, reused) in scripts() {
        bounded(run_script(name, steps, reused)).await;
    }
}

async fn run_script(name: &str, steps: Vec<Step>, reused: bool) {
    let m = Manual::new().await;
    let mut pending = Some(m.spawn(b"{\"n\":1}"));
    let mut c = m.accept().await;
    assert_eq!(c.request().await.expect("request").body, b"{\"n\":1}");
    let mut body: Option<LegBody> = None;
    let mut slow = None;
    for (k, step) in steps.into_iter().enumerate() {
        let at = format!("{name}, step {k}");
        match step {
            W(b) => c.send(&b).await,
            Trickle(b, piece) => slow = Some((b, piece)),
            Close => c.s.shutdown().await.unwrap(),
            Head(status) => {
                let leg = pending.take().expect("one head");
                let (r, ()) = tokio::join!(leg, trickle(&mut c.s, slow.take()));
                let resp = r.unwrap().unwrap_or_else(|e| panic!("{at}: {e}"));
                assert_eq!(resp.status().as_u16(), status, "{at}");
                body = Some(resp.into_body());
            }
            Data(want, end) => {
                let b = body.as_mut().expect("head first");
                let (got, ()) =
                    tokio::join!(data_until(b, want.len()), trickle(&mut c.s, slow.take()));
                let got = got.unwrap_or_else(|e| panic!("{at}: {e}"));
                assert!(got == want, "{at}: got {:?}", String::from_utf8_lossy(&got));
                if let Some(end) = end {
                    assert_eq!(b.is_end_stream(), end, "{at}: is_end_stream");
                }
            }
            End => {
                let b = body.as_mut().expect("head first");
                let (f, ()) = tokio::join!(b.frame(), trickle(&mut c.s, slow.take()));
                assert!(f.is_none(), "{at}: expected the end, got {f:?}");
                assert!(b.is_end_stream(), "{at}");
            }
        }
    }
    assert_eq!(m.host.idle_count(), usize::from(reused), "{name}: idle");
    let next = m.spawn(b"{\"n\":2}");
    let mut c = if reused {
        c
    } else {
        assert!(
            c.request().await.is_none(),
            "{name}: the client kept the connection"
        );
        m.accept().await
    };
    let r = tokio::select! {
        r = c.request() => r.expect("second request"),
        _ = m.listener.accept() => panic!("{name}: a new connection instead of the idle one"),
    };
    assert_eq!(r.body, b"{\"n\":2}", "{name}");
    c.send(OK2).await;
    assert_eq!(
        body_bytes(next.await.unwrap().unwrap()).await,
        b"ok",
        "{name}"
    );
    assert_eq!(m.host.idle_count(), 1, "{name}: idle after the second leg");
}

/// N sequential legs on one server: one connection for all when the answer allows
/// keep-alive, one per leg otherwise.
#[tokio::test(crate = "crate::support::rt")]
async fn sequential_legs_share_one_connection() {
    // (name, answer, the server closes after it, body, reused)
    type Case = (&'static str, &'static [u8], bool, &'static [u8], bool);
    #[rustfmt::skip]
    let cases: &[Case] = &[
        ("length", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", false, b"hello", true),
        ("chunked", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", false, b"hello", true),
        ("204", b"HTTP/1.1 204 No Content\r\n\r\n", false, b"", true),
        ("close-delimited", b"HTTP/1.1 200 OK\r\n\r\nhello", true, b"hello", false),
        ("connection: close", b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 5\r\n\r\nhello", true, b"hello", false),
    ];
    const N: usize = 5;
    for &(name, answer, server_closes, want, reused) in cases {
        bounded(async {
            let srv = serve(move |mut c| async move {
                if server_closes {
                    if c.request().await.is_some() {
                        c.send(answer).await;
                    }
                } else {
                    c.answer_all(answer).await;
                }
            })
            .await;
            let up = upstream(|_| {});
            for k in 0..N {
                let (_, body) = call(&up, &srv.host)
                    .await
                    .unwrap_or_else(|e| panic!("{name} #{k}: {e}"));
                assert_eq!(body, want, "{name} #{k}");
            }
            assert_eq!(
                srv.accepted(),
                if reused { 1 } else { N },
                "{name}: connections"
            );
            assert_eq!(srv.host.idle_count(), usize::from(reused), "{name}: idle");
        })
        .await;
    }
}

// ---------------------------------------------------------------- resending a request

/// What connection 0 does after answering the first leg with keep-alive.
#[derive(Clone, Copy, Debug)]
enum Conn0 {
    /// Closes while idle (RST when `reset`); the test waits until the client's reactor has
    /// seen the close when `seen`.
    IdleClose { reset: bool, seen: bool },
    /// Reads the second request whole, writes `answer`, then closes (RST when `reset`).
    ReadThen(&'static [u8], bool),
    /// Reads the second request's head only, then resets the connection: the client's write
    /// of its large body fails part-way.
    ResetMidBody,
}

/// A request is sent once more (on a new connection) only when the engine cannot have read
/// all of it: its connection was seen closed before the write, or the write failed part-way.
/// Once it was written whole, an EOF or reset before the answer is `ClosedAfterWrite`, never
/// a resend (the same rid and bootstrap room would run twice).
#[tokio::test(crate = "crate::support::rt")]
async fn a_request_the_engine_may_have_read_is_never_resent() {
    type Check = fn(&LegError) -> bool;
    fn after_write(e: &LegError) -> bool {
        matches!(e, LegError::ClosedAfterWrite { reused: true, .. }) && e.engine_may_have_read()
    }
    fn reset_after_write(e: &LegError) -> bool {
        matches!(e, LegError::ClosedAfterWrite { reused: true, source: Some(io) }
            if io.kind() == std::io::ErrorKind::ConnectionReset)
    }
    fn retry_closed(e: &LegError) -> bool {
        matches!(
            e,
            LegError::ClosedAfterWrite {
                reused: false,
                source: None
            }
        )
    }
    let ok: Option<Check> = None;
    let idle = |reset, seen| Conn0::IdleClose { reset, seen };
    // (name, what conn 0 does, conn 1 closes after reading, error, conn of each request read)
    type Case = (&'static str, Conn0, bool, Option<Check>, &'static [usize]);
    #[rustfmt::skip]
    let cases: &[Case] = &[
        ("idle close seen before the leg", idle(false, true), false, ok, &[0, 1]),
        ("idle reset seen before the leg", idle(true, true), false, ok, &[0, 1]),
        ("closed after reading (FIN)", Conn0::ReadThen(b"", false), false, Some(after_write), &[0, 0]),
        ("closed after reading (RST)", Conn0::ReadThen(b"", true), false, Some(reset_after_write), &[0, 0]),
        ("garbage answer", Conn0::ReadThen(b"HTX/1.1 200 OK\r\n\r\n", false), false, Some(protocol), &[0, 0]),
        ("partial head then close", Conn0::ReadThen(b"HTTP/1.1 200 O", false), false, Some(closed_early), &[0, 0]),
        ("write failed part-way", Conn0::ResetMidBody, false, ok, &[0, 1]),
        ("write failed part-way, then the new connection closes after reading", Conn0::ResetMidBody, true, Some(retry_closed), &[0, 1]),
    ];
    let big: Arc<Vec<u8>> = Arc::new(vec![b' '; 32 << 20]);
    for &(name, then, conn1_closes, err, conns) in cases {
        bounded(async {
            let mut srv = serve(move |mut c| async move {
                match c.i {
                    0 => {
                        c.request().await.expect("first request");
                        c.send(OK2).await;
                        match then {
                            Conn0::IdleClose { reset, .. } => c.close(reset),
                            Conn0::ReadThen(answer, reset) => {
                                if c.request().await.is_some() {
                                    c.send(answer).await;
                                    c.close(reset);
                                }
                            }
                            Conn0::ResetMidBody => {
                                c.head_only().await;
                                c.close(true);
                            }
                        }
                    }
                    1 if conn1_closes => {
                        let _ = c.request().await;
                    }
                    _ => c.answer_all(OK2).await,
                }
            })
            .await;
            let up = upstream(|_| {});
            assert_eq!(call(&up, &srv.host).await.unwrap().1, b"ok", "{name}");
            assert_eq!(srv.host.idle_count(), 1, "{name}");
            if let Conn0::IdleClose { seen: true, .. } = then {
                assert_eq!(srv.closed().await, 0);
                reactor_turn().await;
            }
            let body = match then {
                Conn0::ResetMidBody => big.to_vec(),
                _ => b"{}".to_vec(),
            };
            let r = up.send_leg(&srv.host, &leg(&srv.host, &body)).await;
            match (r, err) {
                (Ok(resp), None) => assert_eq!(body_bytes(resp).await, b"ok", "{name}"),
                (Err(e), Some(want)) => assert!(want(&e), "{name}: {e:?}"),
                (r, _) => panic!("{name}: unexpected {r:?}"),
            }
            assert_eq!(srv.accepted(), conns.last().unwrap() + 1, "{name}");
            assert_eq!(srv.request_conns(), conns, "{name}");
            assert_eq!(srv.host.idle_count(), usize::from(err.is_none()), "{name}");
        })
        .await;
    }
}

/// An idle connection the engine closed just before the leg (the client may not have seen
/// it yet): either the close was seen and the leg goes on a new connection, or the leg was
/// written into the closed connection and fails as `ClosedAfterWrite`. Never both: the
/// request reaches an engine at most once.
#[tokio::test(crate = "crate::support::rt")]
async fn idle_close_racing_the_leg_reaches_the_engine_at_most_once() {
    for reset in [false, true] {
        bounded(async {
            let mut srv = serve(move |mut c| async move {
                if c.i == 0 {
                    c.request().await.expect("first request");
                    c.send(OK2).await;
                    c.close(reset);
                } else {
                    c.answer_all(OK2).await;
                }
            })
            .await;
            let up = upstream(|_| {});
            call(&up, &srv.host).await.unwrap();
            match call(&up, &srv.host).await {
                Ok((_, body)) => {
                    assert_eq!(body, b"ok");
                    assert_eq!(srv.request_conns(), [0, 1], "reset={reset}");
                }
                Err(e) => {
                    assert!(
                        matches!(e, LegError::ClosedAfterWrite { reused: true, .. }),
                        "reset={reset}: {e:?}"
                    );
                    assert_eq!(srv.request_conns(), [0], "reset={reset}");
                    assert_eq!(srv.accepted(), 1, "reset={reset}");
                }
            }
        })
        .await;
    }
}
